// Private helpers of the report page (report_page.h): the encodings it embeds.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace epx::observe_detail {

std::string base64(std::span<const uint8_t> bytes);

// `value` as JSON text that is safe inside <script>: "</" written "<\/".
std::string script_safe(std::string json);

// Text safe inside HTML.
std::string html_escape(const std::string& text);

}  // namespace epx::observe_detail
