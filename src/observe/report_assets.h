// The run report's inline stylesheet and script (report_assets.cc).
#pragma once

#include <string_view>

namespace epx::observe_detail {

std::string_view report_style();
std::string_view report_script();

}  // namespace epx::observe_detail
