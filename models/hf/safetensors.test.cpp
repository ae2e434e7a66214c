// safetensors: round trips of every dtype, a file written by the Python library, every malformed
// file the reader must reject (with the file and tensor named), and atomic writes.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <random>

#include "models/hf/safetensors.hpp"
#include "models/hf/testing.hpp"

using namespace troupe;
using namespace troupe::models::hf;
using namespace troupe::models::hf::testing;
using Catch::Contains;

namespace {

// Pseudo-random bytes: a round trip must preserve every bit pattern (NaNs included).
owned_tensor random_bytes_tensor(const shape& s, dtype t, std::uint64_t seed) {
  owned_tensor x = empty(s, t);
  std::mt19937_64 g(seed);
  auto* p = static_cast<unsigned char*>(x.data());
  for (std::size_t i = 0; i < x.nbytes(); ++i) p[i] = static_cast<unsigned char>(g());
  return x;
}

// The expected message of a bad file: both the file and the tensor named.
std::string open_error(const fs::path& p) {
  auto f = safetensors_file::open(p);
  REQUIRE_FALSE(f.has_value());
  CHECK_THAT(f.error_message(), Contains(p.string()));
  return f.error_message();
}

// A valid two-tensor file (a: F32 [2], b: F32 [3]) with the header text given.
std::string two_tensors(const std::string& header) {
  return raw_safetensors(header, std::string(20, '\x01'));
}
const std::string good_header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"F32","shape":[3],"data_offsets":[8,20]}})";

}  // namespace

TEST_CASE("Every dtype survives a safetensors round trip bit for bit", "[cpu]") {
  temp_dir dir;
  const struct {
    const char* name;
    dtype type;
    shape sizes;
  } cases[] = {
      {"w.f32", dtype::f32, {3, 5}},    {"w.bf16", dtype::bf16, {7}}, {"w.f16", dtype::f16, {2, 3}},
      {"w.f64", dtype::f64, {2, 2, 2}}, {"w.i32", dtype::i32, {4}},   {"w.i64", dtype::i64, {3}},
      {"w.u8", dtype::u8, {9}},         {"scalar", dtype::f32, {}},   {"empty", dtype::f16, {0, 3}},
  };
  std::vector<owned_tensor> storage;
  std::vector<named_tensor> tensors;
  std::uint64_t seed = 1;
  for (const auto& c : cases) {
    storage.push_back(random_bytes_tensor(c.sizes, c.type, seed++));
    tensors.push_back({c.name, storage.back()});
  }
  const fs::path p = dir / "all.safetensors";
  auto size = save_safetensors(p, tensors, {{"format", "pt"}, {"note", "round trip"}});
  REQUIRE(size.has_value());
  CHECK(*size == fs::file_size(p));
  CHECK(list_files(dir.path()) == std::vector<std::string>{"all.safetensors"});  // no .tmp left

  // The header is padded to 8 bytes and every tensor aligned to its element size.
  const std::string bytes = read_bytes(p);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  CHECK(n % 8 == 0);

  auto f = safetensors_file::open(p);
  REQUIRE(f.has_value());
  CHECK(f->metadata().at("format") == "pt");
  CHECK(f->metadata().at("note") == "round trip");
  REQUIRE(f->tensors().size() == std::size(cases));
  for (std::size_t i = 0; i < std::size(cases); ++i) {
    INFO(cases[i].name);
    const safetensors_entry* e = f->find(cases[i].name);
    REQUIRE(e != nullptr);
    CHECK(e->type == cases[i].type);
    CHECK(e->sizes == cases[i].sizes);
    CHECK(e->aligned());
    REQUIRE(e->nbytes() == storage[i].nbytes());
    CHECK(std::memcmp(e->data, storage[i].data(), e->nbytes()) == 0);
  }
  CHECK(f->find("absent") == nullptr);
}

TEST_CASE("A file written by the Python safetensors library reads back its values", "[cpu]") {
  auto f = safetensors_file::open(fixture_dir() / "dtypes.safetensors");
  REQUIRE(f.has_value());
  CHECK(f->metadata().at("format") == "pt");
  CHECK(f->metadata().at("source") == "troupe fixture");
  // value(k) = (k % 13 - 6) / 4; integers k % 13 - 6; u8 k % 13 (see the script).
  auto value = [](std::int64_t k) { return static_cast<double>(k % 13 - 6) / 4; };
  auto check = [&](const char* name, dtype t, const shape& s, auto read) {
    INFO(name);
    const safetensors_entry* e = f->find(name);
    REQUIRE(e != nullptr);
    CHECK(e->type == t);
    REQUIRE(e->sizes == s);
    for (std::int64_t k = 0; k < s.numel(); ++k) CHECK(read(e->data, k) == value(k));
  };
  auto as = []<class T>(const std::byte* d, std::int64_t k, T*) {
    T v;
    std::memcpy(&v, d + k * sizeof(T), sizeof(T));
    return v;
  };
  check("f32", dtype::f32, {2, 3},
        [&](auto d, auto k) { return double(as(d, k, static_cast<float*>(nullptr))); });
  check("f64", dtype::f64, {3}, [&](auto d, auto k) { return as(d, k, (double*)nullptr); });
  check("bf16", dtype::bf16, {4}, [&](auto d, auto k) {
    return double(bf16_bits_to_f32(as(d, k, static_cast<std::uint16_t*>(nullptr))));
  });
  check("f16", dtype::f16, {2, 2}, [&](auto d, auto k) {
    return double(f16_bits_to_f32(as(d, k, static_cast<std::uint16_t*>(nullptr))));
  });
  check("i32", dtype::i32, {2},
        [&](auto d, auto k) { return as(d, k, static_cast<std::int32_t*>(nullptr)) / 4.0; });
  check("i64", dtype::i64, {5}, [&](auto d, auto k) {
    return static_cast<double>(as(d, k, static_cast<std::int64_t*>(nullptr))) / 4.0;
  });
  const safetensors_entry* u8 = f->find("u8");
  REQUIRE(u8 != nullptr);
  CHECK(u8->type == dtype::u8);
  for (int k = 0; k < 3; ++k) CHECK(static_cast<int>(u8->data[k]) == k % 13);
  check("scalar", dtype::f32, {},
        [&](auto d, auto k) { return double(as(d, k, static_cast<float*>(nullptr))); });
  REQUIRE(f->find("empty") != nullptr);
  CHECK(f->find("empty")->sizes == shape{0, 4});
  CHECK(f->find("empty")->nbytes() == 0);
}

TEST_CASE("read_into converts dtypes and transposes", "[cpu]") {
  auto f = safetensors_file::open(fixture_dir() / "dtypes.safetensors");
  REQUIRE(f.has_value());
  owned_tensor t = empty({3, 2}, dtype::f64);
  read_into(*f->find("f32"), t, /*transpose=*/true);  // f32 [2, 3] -> f64 [3, 2]
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j)
      CHECK(t.data_as<double>()[i * 2 + j] == static_cast<double>((j * 3 + i) % 13 - 6) / 4);
  owned_tensor h = empty({4}, dtype::f32);
  read_into(*f->find("bf16"), h);
  for (int k = 0; k < 4; ++k) CHECK(h.data_as<float>()[k] == static_cast<float>(k % 13 - 6) / 4);
}

TEST_CASE("Malformed safetensors files are rejected naming the file and the tensor",
          "[cpu][faults]") {
  temp_dir dir;
  // The fault matrix's line for a case (ctest -L faults).
  auto refused = [](const char* what, std::string message) {
    std::printf("faults: safetensors %s -> refused: %s\n", what, message.c_str());
    return message;
  };
  const fs::path p = dir / "bad.safetensors";
  auto with_header = [&](const std::string& header, std::size_t data_bytes = 20) {
    write_bytes(p, raw_safetensors(header, std::string(data_bytes, '\x01')));
    return open_error(p);
  };
  // The good file opens, so each case below fails for its own reason.
  write_bytes(p, two_tensors(good_header));
  REQUIRE(safetensors_file::open(p).has_value());

  SECTION("a file shorter than the header length") {
    write_bytes(p, "abc");
    CHECK_THAT(refused("of 3 bytes", open_error(p)),
               Contains("shorter than the 8-byte header length"));
    write_bytes(p, "");
    CHECK_THAT(open_error(p), Contains("0 bytes"));
  }
  SECTION("a header length beyond the file") {
    std::string bytes = two_tensors(good_header);
    bytes[5] = '\x01';  // a header of about a terabyte
    write_bytes(p, bytes);
    CHECK_THAT(refused("header length past the end", open_error(p)),
               Contains("runs past the end of the file"));
  }
  SECTION("a header that is not JSON") {
    CHECK_THAT(refused("corrupt header", with_header(R"({"a": {"dtype": "F32",)")),
               Contains("not valid JSON"));
  }
  SECTION("a header that is not an object") {
    CHECK_THAT(with_header("[1, 2, 3]"), Contains("not a JSON object"));
  }
  SECTION("an unknown dtype") {
    std::string h = good_header;
    h.replace(h.find("F32"), 3, "F8_E4M3");
    CHECK_THAT(refused("unknown dtype", with_header(h)),
               Contains("tensor 'a'") && Contains("unknown or unsupported dtype 'F8_E4M3'"));
  }
  SECTION("a shape that does not match the byte span") {
    std::string h = good_header;
    h.replace(h.find("[3]"), 3, "[4]");
    CHECK_THAT(with_header(h),
               Contains("tensor 'b'") && Contains("span 12 bytes but shape [4] of F32 needs 16"));
  }
  SECTION("offsets outside the data section") {
    CHECK_THAT(with_header(good_header, 16),
               Contains("tensor 'b'") && Contains("lie outside the data section (16 bytes)"));
  }
  SECTION("a truncated file") {
    std::string bytes = two_tensors(good_header);
    write_bytes(p, bytes.substr(0, bytes.size() - 3));
    CHECK_THAT(refused("truncated by 3 bytes", open_error(p)),
               Contains("tensor 'b'") && Contains("truncated"));
  }
  SECTION("overlapping tensors") {
    const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}})";
    CHECK_THAT(with_header(h, 16), Contains("tensor 'b'") && Contains("overlap tensor 'a'"));
  }
  SECTION("a hole between tensors and bytes after the last one") {
    const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[3],"data_offsets":[12,24]}})";
    CHECK_THAT(with_header(h, 24), Contains("tensor 'b'") && Contains("hole of 4 bytes"));
    CHECK_THAT(with_header(good_header, 24), Contains("trailing bytes"));
  }
  SECTION("offsets that end before they begin") {
    const std::string h = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})";
    CHECK_THAT(with_header(h, 0), Contains("tensor 'a'") && Contains("end before they begin"));
  }
  SECTION("a tensor named twice") {
    const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
    CHECK_THAT(with_header(h, 16), Contains("tensor 'a'") && Contains("named twice"));
  }
  SECTION("entries of the wrong JSON types") {
    CHECK_THAT(with_header(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
               Contains("tensor 'a'") && Contains("shape must hold non-negative integers"));
    CHECK_THAT(with_header(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8),
               Contains("tensor 'a'") && Contains("shape"));
    CHECK_THAT(with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8),
               Contains("tensor 'a'") && Contains("data_offsets must be an array [begin, end]"));
    CHECK_THAT(with_header(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8),
               Contains("tensor 'a'") && Contains("dtype"));
    CHECK_THAT(with_header(R"({"a":[1]})", 8), Contains("tensor 'a'") && Contains("not an object"));
    CHECK_THAT(with_header(R"({"__metadata__":{"k":1}})", 0),
               Contains("__metadata__ entry 'k' must be a string"));
    CHECK_THAT(
        with_header(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1,1,2],"data_offsets":[0,8]}})", 8),
        Contains("tensor 'a'") && Contains("more than 6 dimensions"));
  }
  SECTION("a missing file") {
    auto f = safetensors_file::open(dir / "absent.safetensors");
    REQUIRE_FALSE(f.has_value());
    CHECK_THAT(f.error_message(), Contains("absent.safetensors") && Contains("cannot open"));
  }
}

TEST_CASE("A failed safetensors write leaves the existing file and no temporary file", "[cpu]") {
  temp_dir dir;
  const fs::path p = dir / "w.safetensors";
  owned_tensor small = random_bytes_tensor({4}, dtype::f32, 3);
  REQUIRE(save_safetensors(p, {{"x", small}}).has_value());
  const std::string before = read_bytes(p);
  owned_tensor big = random_bytes_tensor({1 << 16}, dtype::f32, 4);  // 256 KiB

  SECTION("the disk fills up in the middle of the data") {
    expected<std::uint64_t> r = std::uint64_t{0};
    {
      file_size_limit limit(64 * 1024);
      r = save_safetensors(p, {{"x", big}});
    }
    REQUIRE_FALSE(r.has_value());
    CHECK_THAT(r.error_message(), Contains("w.safetensors.tmp") && Contains("cannot write"));
  }
  SECTION("the temporary file cannot be created") {
    fs::create_directory(dir / "w.safetensors.tmp");  // in the way of the temporary file
    auto r = save_safetensors(p, {{"x", big}});
    REQUIRE_FALSE(r.has_value());
    CHECK_THAT(r.error_message(), Contains("cannot create"));
    fs::remove(dir / "w.safetensors.tmp");
  }
  SECTION("the folder does not exist") {
    auto r = save_safetensors(dir / "absent" / "w.safetensors", {{"x", big}});
    REQUIRE_FALSE(r.has_value());
    CHECK_THAT(r.error_message(), Contains("absent/w.safetensors.tmp"));
  }
  SECTION("a tensor is not on the host or not contiguous") {
    owned_tensor m = random_bytes_tensor({2, 3}, dtype::f32, 5);
    auto r = save_safetensors(p, {{"t", m.transpose(0, 1)}});
    REQUIRE_FALSE(r.has_value());
    CHECK_THAT(r.error_message(), Contains("tensor 't'") && Contains("contiguous host tensor"));
    r = save_safetensors(p, {{"t", m}, {"t", m}});
    CHECK_THAT(r.error_message(), Contains("tensor 't'") && Contains("named twice"));
  }
  CHECK(read_bytes(p) == before);
  CHECK(list_files(dir.path()) == std::vector<std::string>{"w.safetensors"});
}
