// The request codec: round trips of the supported shapes, and corrupt payloads that must fail.
#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "actors/codec.hpp"
#include "actors/roles.hpp"

namespace {

using namespace troupe::actors;

enum class color : std::uint8_t { red = 1, green = 2 };

struct inner {
  std::string label;
  std::vector<float> values;
  auto fields() { return std::tie(label, values); }
  bool operator==(const inner&) const = default;
};

struct outer {
  std::int32_t id = 0;
  color c = color::red;
  std::vector<inner> items;
  std::map<std::string, double> metrics;
  std::optional<std::string> note;
  std::array<std::int16_t, 3> triple{};
  std::pair<int, std::string> pair;
  std::vector<bool> flags;
  auto fields() { return std::tie(id, c, items, metrics, note, triple, pair, flags); }
  bool operator==(const outer&) const = default;
};

struct plain {  // trivially copyable: travels as raw bytes
  double x;
  std::int64_t y;
  bool operator==(const plain&) const = default;
};

struct named {
  static constexpr const char* kind = "example.named";
  int v = 0;
};

}  // namespace

TEST_CASE("Structs with fields round trip through the codec") {
  outer o;
  o.id = -42;
  o.c = color::green;
  o.items = {{"a", {1.5f, -2.0f}}, {"", {}}, {"long label", std::vector<float>(1000, 0.25f)}};
  o.metrics = {{"loss", 2.5}, {"step", 7}};
  o.note = "hello";
  o.triple = {1, -2, 3};
  o.pair = {9, "nine"};
  o.flags = {true, false, true};
  const bytes b = encode(o);
  CHECK(decode<outer>(b) == o);
  o.note.reset();
  CHECK(decode<outer>(encode(o)) == o);
  const plain p{3.25, -7};
  CHECK(decode<plain>(encode(p)) == p);
  CHECK(decode<std::string>(encode(std::string("x\0y", 3))) == std::string("x\0y", 3));
}

TEST_CASE("Role handles travel inside requests") {
  role_handle h;
  h.name = "worker@3";
  h.role = "worker";
  h.rank = 3;
  h.channel = 5;
  auto back = decode<role_handle>(encode(h));
  CHECK(back.name == h.name);
  CHECK(back.role == h.role);
  CHECK(back.rank == 3);
  CHECK(back.channel == 5);
}

TEST_CASE("Truncated and oversized payloads are errors naming the type") {
  outer o;
  o.items = {{"abc", {1, 2, 3}}};
  bytes b = encode(o);
  for (std::size_t cut : {std::size_t(0), std::size_t(3), b.size() / 2, b.size() - 1}) {
    bytes shorter(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(cut));
    CHECK_THROWS_WITH(decode<outer>(shorter), Catch::Contains("decode"));
  }
  bytes longer = b;
  longer.push_back(0);
  CHECK_THROWS_WITH(decode<outer>(longer), Catch::Contains("trailing"));
  // A length field far beyond the payload does not allocate or read past the end.
  bytes huge = encode(std::string("abc"));
  huge[7] = 0x7f;
  CHECK_THROWS_WITH(decode<std::string>(huge), Catch::Contains("exceeds"));
}

TEST_CASE("Request kinds come from a kind member or the type") {
  CHECK(kind_of<named>() == "example.named");
  CHECK(kind_of<plain>() != kind_of<outer>());
}
