"""Table of bench/lowlat_two_hosts.sh's runs: per (ranks per host, link,
tokens), the median over the rounds of normal time / low-latency time for
dispatch and combine (above 1: low latency faster), per variant (before,
after, after with the per-rank combine), and the median CPU times (ms, all
ranks) of normal / low latency.
Usage: python3 bench/lowlat_two_hosts.py OUT_DIR"""
import collections
import glob
import os
import re
import statistics
import sys

NAME = re.compile(r"r(\d+)_np(\d)_(\w+)_(before|after|perrank)\.txt")


def rows_of(path):
    """The bench's table rows: tokens, times (ms) and CPU times (ms)."""
    started = False
    for line in open(path):
        if line.startswith("tokens"):
            started = True
            continue
        p = line.split()
        if not started or "tokens/rank" in line or len(p) < 18 or not p[0].isdigit():
            started = started and "tokens/rank" in line
            continue
        yield dict(tokens=int(p[0]), dn=float(p[2]), dl=float(p[4]), cn=float(p[7]), cl=float(p[9]),
                   cdn=float(p[12]), cdl=float(p[14]), ccn=float(p[15]), ccl=float(p[17]))


def main(out):
    cells = collections.defaultdict(list)
    for path in glob.glob(os.path.join(out, "r*_np*.txt")):
        m = NAME.match(os.path.basename(path))
        if m:
            for r in rows_of(path):
                cells[(m.group(2), m.group(3), m.group(4), r["tokens"])].append(r)
    med = statistics.median

    def summary(rs):
        return {key: med(r[key] for r in rs) for key in rs[0]} | {
            "dr": med(r["dn"] / r["dl"] for r in rs), "cr": med(r["cn"] / r["cl"] for r in rs), "n": len(rs)}

    def ratio(x):
        return f"**{x:.2f}x**" if x >= 1 else f"{x:.2f}x"

    print("| ranks per host | link | tokens | before: dispatch, combine | after: dispatch, combine | "
          "after, per-rank combine | CPU ms dispatch n / ll: before, after | CPU ms combine n / ll: before, after, "
          "per-rank |")
    print("|---:|---|---:|---|---|---|---|---|")
    for np_ in ("1", "2"):
        for link in ("uncapped", "300mbit"):
            for tokens in sorted({k[3] for k in cells}):
                s = {v: summary(cells[(np_, link, v, tokens)]) for v in ("before", "after", "perrank")
                     if cells.get((np_, link, v, tokens))}
                if "after" not in s:
                    continue
                b, a, p = s.get("before"), s["after"], s.get("perrank")

                def both(x, first, second, fmt):
                    return f"{fmt(x[first])}, {fmt(x[second])}" if x else "-"

                def cpu(x, first, second):
                    return f"{x[first]:.2f} / {x[second]:.2f}" if x else "-"

                link_name = "uncapped" if link == "uncapped" else "300 Mbit/s"
                print(f"| {np_} | {link_name} | {tokens} | {both(b, 'dr', 'cr', ratio)} | {both(a, 'dr', 'cr', ratio)} | "
                      f"{ratio(p['cr']) if p else '-'} | {cpu(b, 'cdn', 'cdl')}, {cpu(a, 'cdn', 'cdl')} | "
                      f"{cpu(b, 'ccn', 'ccl')}, {cpu(a, 'ccn', 'ccl')}, {cpu(p, 'ccn', 'ccl')} |")

if __name__ == "__main__":
    main(sys.argv[1])
