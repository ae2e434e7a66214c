// The introspection dashboard: one self-contained HTML page (inline CSS and JavaScript, SVG charts,
// no network fetches but the endpoint's own /json) served at "/" by http_server. It polls /json
// every second and draws the job's topology (ranks on the dp x pp x tp grid with each role actor's
// activity), per-step charts of loss, tokens/s, gradient norm, memory per tier and pipeline bubble
// (from the actors' step histories), the collectives in flight and the membership event log.
//
// The page is introspection/dashboard.html, embedded at build time (cmake/EmbedText.cmake).
#pragma once

#include <string_view>

namespace troupe::actors {

std::string_view dashboard_html();

}  // namespace troupe::actors
