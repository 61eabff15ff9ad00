// The run report's stylesheet (report_style.css) and script
// (report_script.js), inlined into every page (the page loads nothing). Both
// are files of their own, embedded at configure time as raw string literals
// (src/CMakeLists.txt). The script draws each <section class="chart"> from
// the JSON in its <script class="chart-data">: line charts, stacked bars and
// timelines as SVG, heatmaps on a canvas (one pixel per cell, scaled up), and
// sets data-rendered to what it drew; a chart that fails gets the class
// chart-error and a console error, which the browser test looks for.
#include "observe/report_assets.h"

namespace epx::observe_detail {

std::string_view report_style() {
  return
#include "observe/report_style.css.inc"
      ;
}

std::string_view report_script() {
  return
#include "observe/report_script.js.inc"
      ;
}

}  // namespace epx::observe_detail
