// The introspection dashboard in a real browser: a 4-rank dp 2 x pp 2 job trains, headless
// Chromium loads the page from the launcher's endpoint, and the DOM it leaves after its scripts ran
// must show every rank on the grid and the job's real per-step series in every chart. A screenshot
// is kept as an artifact (build/artifacts/dashboard.png). Skipped where Chromium is not installed
// (scripts/setup.sh installs it).
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "tests/multirank/process.hpp"

namespace {

using troupe::tests::child_process;
using troupe::tests::run_command;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

const std::string troupe_bin = TROUPE_BIN;
const std::string artifacts_dir = TROUPE_ARTIFACTS_DIR;

// Debian's `chromium` (or another build's name) on PATH; empty when there is none.
std::string find_chromium() {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  for (const char* name : {"chromium", "chromium-browser", "google-chrome"}) {
    std::size_t start = 0;
    while (start <= dirs.size()) {
      std::size_t end = dirs.find(':', start);
      if (end == std::string::npos) end = dirs.size();
      const fs::path candidate = fs::path(dirs.substr(start, end - start)) / name;
      if (!candidate.parent_path().empty() && ::access(candidate.c_str(), X_OK) == 0)
        return candidate.string();
      start = end + 1;
    }
  }
  return {};
}

// The endpoint's URL from the launcher's first line ("introspection http://127.0.0.1:PORT/").
std::string endpoint_url(const child_process& launcher) {
  static const std::regex re("introspection (http://[^ ,]+/)");
  std::smatch m;
  for (const auto& l : launcher.lines_with("introspection http://"))
    if (std::regex_search(l, m, re)) return m[1];
  return {};
}

// The values of attribute `attr` of every element that also carries `key`="...": key -> value.
std::map<std::string, int> attribute_pairs(const std::string& dom, const std::string& key,
                                           const std::string& attr) {
  std::map<std::string, int> out;
  const std::regex re(key + "=\"([^\"]*)\"[^>]*?" + attr + "=\"([0-9]+)\"");
  for (auto it = std::sregex_iterator(dom.begin(), dom.end(), re); it != std::sregex_iterator();
       ++it)
    out[(*it)[1]] = std::stoi((*it)[2]);
  return out;
}

}  // namespace

TEST_CASE("The dashboard shows every rank and the per-step charts of a training job in Chromium",
          "[multirank]") {
  const std::string chromium = find_chromium();
  if (chromium.empty()) {
    WARN("troupe-skip: chromium is not installed (scripts/setup.sh installs it)");
    return;
  }
  const std::string job = "dashboard-" + std::to_string(::getpid());
  const fs::path profile = fs::temp_directory_path() / ("troupe-chromium-" + job);
  fs::remove_all(profile);
  // dp 2 x pp 2 as the demo runs it, logging every step; stopped by the test.
  child_process launcher({troupe_bin,    "launch",    "-n",
                          "4",           "--job",     job,
                          "--",          troupe_bin,  "train",
                          "--demo",      "--dp",      "2",
                          "--pp",        "2",         "--microbatches",
                          "4",           "--steps",   "100000",
                          "--log-every", "1",         "--sample",
                          "0",           "--threads", "1"});
  const int k = 5;  // steps done before the page is loaded
  const bool trained = launcher.wait_for("step     " + std::to_string(k) + "/", 240s);
  const std::string url = endpoint_url(launcher);
  INFO(launcher.output());
  REQUIRE(trained);
  REQUIRE(!url.empty());

  // The DOM after the page's scripts ran: virtual time lets it poll /json a few times.
  const std::vector<std::string> browser = {chromium,
                                            "--headless=new",
                                            "--no-sandbox",  // tests may run as root
                                            "--disable-gpu",
                                            "--hide-scrollbars",
                                            "--user-data-dir=" + profile.string(),
                                            "--virtual-time-budget=4000"};
  auto dump = browser;
  dump.insert(dump.end(), {"--dump-dom", url});
  auto [rc, dom] = run_command(dump, 120s);
  INFO("chromium --dump-dom " << url << " (exit " << rc << "):\n" << dom);
  REQUIRE(rc == 0);

  // The page polled /json at least once and saw the steps done.
  std::smatch m;
  REQUIRE(std::regex_search(dom, m, std::regex("<body[^>]*data-updates=\"([0-9]+)\"")));
  CHECK(std::stoi(m[1]) >= 1);
  REQUIRE(std::regex_search(dom, m, std::regex("<body[^>]*data-step=\"([0-9]+)\"")));
  CHECK(std::stoi(m[1]) >= k);

  // Every chart has at least k points of the job's series (collectives: the page's samples).
  const auto charts = attribute_pairs(dom, "data-chart", "data-points");
  for (const char* name : {"loss", "tokens_per_s", "grad_norm", "memory", "bubble"}) {
    INFO("chart " << name);
    REQUIRE(charts.count(name) == 1);
    CHECK(charts.at(name) >= k);
  }
  REQUIRE(charts.count("collectives") == 1);
  CHECK(charts.at("collectives") >= 1);
  // A bubble series per rank, a memory series per tier in use.
  const auto series = attribute_pairs(dom, "data-chart", "data-series");
  CHECK(series.at("bubble") == 4);
  CHECK(series.at("memory") >= 1);

  // The grid is dp 2 x pp 2 x tp 1 and holds every rank at its coordinates.
  CHECK(std::regex_search(dom, std::regex("id=\"topology\"[^>]*data-ranks=\"4\"")));
  CHECK(std::regex_search(dom, std::regex("id=\"topology\"[^>]*data-dims=\"dp=2,pp=2,tp=1\"")));
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    const std::string coords = "data-rank=\"" + std::to_string(r) + "\" data-dp=\"" +
                               std::to_string(r / 2) + "\" data-pp=\"" + std::to_string(r % 2) +
                               "\" data-tp=\"0\"";
    CHECK(dom.find(coords) != std::string::npos);
    CHECK(dom.find("data-actor=\"trainer@" + std::to_string(r) + "\"") != std::string::npos);
  }
  // The membership log: four joins and the start.
  const std::regex joined("data-kind=\"joined\"");
  CHECK(std::distance(std::sregex_iterator(dom.begin(), dom.end(), joined),
                      std::sregex_iterator()) == 4);
  CHECK(dom.find("data-kind=\"started\"") != std::string::npos);

  // The screenshot, kept as a test artifact.
  fs::create_directories(artifacts_dir);
  const std::string png = artifacts_dir + "/dashboard.png";
  fs::remove(png);
  auto shot = browser;
  shot.insert(shot.end(), {"--window-size=1400,1250", "--screenshot=" + png, url});
  auto [src, sout] = run_command(shot, 120s);
  INFO("chromium --screenshot (exit " << src << "):\n" << sout);
  CHECK(src == 0);
  std::ifstream f(png, std::ios::binary);
  char magic[8] = {};
  f.read(magic, 8);
  CHECK(std::string(magic + 1, 3) == "PNG");
  WARN("dashboard screenshot: " << png);

  launcher.signal(SIGTERM);
  CHECK(launcher.wait(60s).has_value());
  fs::remove_all(profile);
}
