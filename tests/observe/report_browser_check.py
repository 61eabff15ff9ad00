#!/usr/bin/env python3
"""Opens an epx report page in headless Chromium and checks it rendered.

Talks to Chromium over the DevTools protocol on a pipe (--remote-debugging-pipe:
the browser reads commands from fd 3 and writes replies to fd 4, each a JSON
object ended by a NUL byte), with the standard library only. Checks: no console
error, no uncaught exception and no error log entry; every <section class="chart">
drew something (data-rendered > 0, no chart-error class, its SVG or canvas
present and non-empty); the kinds asked for are all there. Keeps a full-page
screenshot and prints one JSON line per page (charts, render time in ms).

One browser serves every page given (each in a fresh tab). Exit 0: every
--page passed and every --must-fail page showed a problem; 1: not (each
problem printed); 77: no Chromium (ctest's SKIP_RETURN_CODE).
"""
import argparse
import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

SKIP = 77

# Runs in the page after rendering: one entry per chart, with what it drew.
INSPECT = r"""
JSON.stringify({
  renderMs: +document.body.dataset.renderMs,
  charts: [...document.querySelectorAll("section.chart")].map(sec => {
    const svg = sec.querySelector(".plot svg"), cv = sec.querySelector(".plot canvas");
    let svgItems = 0, canvasPainted = false;
    if (svg) svgItems = svg.querySelectorAll("path,rect").length;
    if (cv && cv.width > 0 && cv.height > 0) {
      const px = cv.getContext("2d").getImageData(0, 0, cv.width, cv.height).data;
      for (let i = 3; i < px.length; i += 4) if (px[i] > 0) { canvasPainted = true; break; }
    }
    return {id: sec.id, kind: sec.dataset.kind, title: sec.querySelector("h3").textContent,
            rendered: +sec.dataset.rendered, error: sec.classList.contains("chart-error"),
            svgItems, canvas: !!cv, canvasPainted, width: sec.getBoundingClientRect().width,
            height: sec.querySelector(".plot").getBoundingClientRect().height};
  })
})
"""


class Browser:
    """Chromium on a DevTools pipe: send commands, collect events."""

    def __init__(self, chromium, profile_dir):
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # Move the child's ends above 4 so dup2 onto 3 and 4 cannot clobber
        # them; dup2 clears close-on-exec on 3 and 4 only (Python opens every
        # other descriptor close-on-exec, so close_fds=False leaks nothing).
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_browser_r)
        os.close(from_browser_w)

        def child_fds():
            os.dup2(child_r, 3)
            os.dup2(child_w, 4)

        args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                "--user-data-dir=" + profile_dir, "--window-size=1200,900", "about:blank"]
        self.proc = subprocess.Popen(args, preexec_fn=child_fds, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, close_fds=False)
        os.close(child_r)
        os.close(child_w)
        self.out = os.fdopen(to_browser_w, "wb", buffering=0)
        self.inp = os.fdopen(from_browser_r, "rb", buffering=0)
        self.buf = b""
        self.next_id = 0
        self.events = []

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from chromium in time")
            chunk = self.inp.read(65536)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe (exit code %s)" % self.proc.poll())
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method, params=None, session=None, timeout=60):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.out.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError("%s failed: %s" % (method, reply["error"]))
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method, session, timeout=60):
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for e in self.events[seen:]:
                if e.get("method") == method and e.get("sessionId") == session:
                    return e
            seen = len(self.events)
            self.events.append(self._read_message(deadline))

    def close(self):
        try:
            self.send("Browser.close", timeout=10)
        except Exception:  # the browser may already be gone
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def problems_in_events(events):
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console %s: %s" % (p["type"], " ".join(str(a.get("value", a.get("description", "")))
                                                                for a in p.get("args", []))))
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("uncaught exception: %s" % d.get("exception", {}).get("description", d.get("text")))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append("log error: %s" % p["entry"].get("text"))
    return out


def problems_in_charts(charts, expect_kinds):
    out = []
    if not charts:
        out.append("the page has no charts")
    for c in charts:
        name = "%s (%s, %s)" % (c["id"], c["kind"], c["title"])
        if c["error"] or not c["rendered"] > 0:
            out.append("%s drew nothing (data-rendered=%s)" % (name, c["rendered"]))
        if c["kind"] == "heatmap" and not (c["canvas"] and c["canvasPainted"]):
            out.append("%s: its canvas is missing or blank" % name)
        if c["kind"] != "heatmap" and c["svgItems"] == 0:
            out.append("%s: its SVG holds no path or rect" % name)
        if c["width"] <= 0 or c["height"] <= 0:
            out.append("%s has no size on the page" % name)
    kinds = {c["kind"] for c in charts}
    for k in expect_kinds:
        if k not in kinds:
            out.append("no %s chart on the page (kinds: %s)" % (k, ", ".join(sorted(kinds))))
    return out


def check_page(browser, html, screenshot, expect_kinds, timeout, scale=1.0):
    """Opens `html` in a fresh tab; the page's inspection and its problems."""
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    browser.events = []
    for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
        browser.send(domain, session=session)
    started = time.monotonic()
    browser.send("Page.navigate", {"url": "file://" + os.path.abspath(html)}, session=session)
    browser.wait_event("Page.loadEventFired", session, timeout=timeout)
    load_ms = 1e3 * (time.monotonic() - started)
    result = browser.send("Runtime.evaluate", {"expression": INSPECT, "returnByValue": True}, session=session)
    if "exceptionDetails" in result:
        browser.send("Target.closeTarget", {"targetId": target})
        return None, ["inspecting the page failed: %s" % result["exceptionDetails"]]
    page = json.loads(result["result"]["value"])
    page["loadMs"] = round(load_ms, 1)
    metrics = browser.send("Page.getLayoutMetrics", session=session)
    height = min(int(metrics["cssContentSize"]["height"]) + 1, 8000)
    browser.send("Emulation.setDeviceMetricsOverride",
                 {"width": 1200, "height": height, "deviceScaleFactor": scale, "mobile": False}, session=session)
    shot = browser.send("Page.captureScreenshot", {"format": "png"}, session=session, timeout=timeout)
    with open(screenshot, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    problems = problems_in_events([e for e in browser.events if e.get("sessionId") == session]) + problems_in_charts(page["charts"], expect_kinds)
    browser.send("Target.closeTarget", {"targetId": target})
    return page, problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page", nargs=3, action="append", default=[], metavar=("HTML", "SCREENSHOT", "KINDS"),
                    help="a page that must render cleanly, where to keep its screenshot, and the chart kinds "
                         "(comma-separated) it must hold; repeatable")
    ap.add_argument("--must-fail", action="append", default=[], metavar="HTML",
                    help="a page that must show a problem (checks that the checker can fail); repeatable")
    ap.add_argument("--chromium", default=os.environ.get("EPX_CHROMIUM", "chromium"))
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--scale", type=float, default=1.0, help="screenshot pixels per CSS pixel (0.5: half size)")
    a = ap.parse_args()
    chromium = shutil.which(a.chromium)
    if not chromium:
        print("SKIP: no Chromium ('%s' is not on PATH; Debian package chromium, see scripts/setup.sh)" % a.chromium)
        return SKIP
    profile = tempfile.mkdtemp(prefix="epx-chromium-")
    browser = Browser(chromium, profile)
    failed = False
    try:
        for html, screenshot, kinds in a.page:
            page, problems = check_page(browser, html, screenshot, [k for k in kinds.split(",") if k], a.timeout,
                                        a.scale)
            for p in problems:
                print("FAIL: %s: %s" % (html, p))
            failed = failed or bool(problems)
            if page:
                print(json.dumps({"page": html, "bytes": os.path.getsize(html), "charts": len(page["charts"]),
                                  "kinds": sorted({c["kind"] for c in page["charts"]}),
                                  "render_ms": page["renderMs"], "load_ms": page["loadMs"],
                                  "screenshot": screenshot}))
        for html in a.must_fail:
            _, problems = check_page(browser, html, os.devnull, [], a.timeout)
            print("%s: %s" % (html, "; ".join(problems) if problems else "no problem found"))
            if not problems:
                print("FAIL: %s has a broken chart, but the check found no problem" % html)
                failed = True
    finally:
        browser.close()
        shutil.rmtree(profile, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
