// Tests of the CPU GEMM (troupe::ops::matmul on OpenBLAS) against a plain triple loop in double,
// and of the choice of OpenBLAS core (tensor/cpu/blas_info.hpp).
#include <catch2/catch.hpp>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "tensor/cpu/blas_info.hpp"
#include "tensor/ops.hpp"
#include "tensor/tensor.hpp"

extern "C" {
void gotoblas_dynamic_init(void) __attribute__((weak));
void gotoblas_dynamic_quit(void) __attribute__((weak));
}

using namespace troupe;

namespace {

// A [rows, cols] view of an owned buffer: contiguous, transposed (a view of a [cols, rows] buffer)
// or a narrow of a wider buffer (leading dimension cols + pad).
enum class layout_kind { plain, transposed, padded };

struct matrix {
  owned_tensor storage;
  tensor view;
};

matrix make_matrix(std::int64_t rows, std::int64_t cols, dtype t, layout_kind kind,
                   std::mt19937& rng) {
  matrix m;
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  if (kind == layout_kind::transposed) {
    m.storage = empty({cols, rows}, t);
    m.view = m.storage.transpose(0, 1);
  } else if (kind == layout_kind::padded) {
    m.storage = empty({rows, cols + 7}, t);
    m.view = m.storage.narrow(1, 3, cols);
  } else {
    m.storage = empty({rows, cols}, t);
    m.view = m.storage;
  }
  const std::int64_t n = m.storage.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    if (t == dtype::f32)
      m.storage.data_as<float>()[i] = static_cast<float>(u(rng));
    else
      m.storage.data_as<double>()[i] = u(rng);
  }
  return m;
}

double at(const tensor& x, std::int64_t i, std::int64_t j) {
  const std::int64_t o = i * x.stride(0) + j * x.stride(1);
  return x.type() == dtype::f32 ? static_cast<double>(static_cast<const float*>(x.data())[o])
                                : static_cast<const double*>(x.data())[o];
}

// c = alpha * a @ b + beta * c0 in double, and the largest |a||b| sum per element for tolerances.
std::vector<double> reference(const tensor& a, const tensor& b, const std::vector<double>& c0,
                              double alpha, double beta, std::vector<double>& magnitude) {
  const std::int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  std::vector<double> c(m * n);
  magnitude.assign(m * n, 0.0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0, mag = 0;
      for (std::int64_t p = 0; p < k; ++p) {
        s += at(a, i, p) * at(b, p, j);
        mag += std::abs(at(a, i, p) * at(b, p, j));
      }
      c[i * n + j] = alpha * s + beta * c0[i * n + j];
      magnitude[i * n + j] = std::abs(alpha) * mag + std::abs(beta * c0[i * n + j]);
    }
  return c;
}

// Runs one matmul and compares it elementwise with the reference. A dot product of length k
// summed in any order (whatever OpenBLAS core, blocking or thread split runs it), scaled by alpha
// and added to beta * c0, errs by at most (k + 2) u * mag with u the unit roundoff (eps / 2) and
// mag = |alpha| sum |a_p b_p| + |beta c0|. The bound 2 (k + 2) eps mag = 4 (k + 2) u mag covers
// that for the kernel and, for f64, the same again for the double reference.
void check_matmul(std::int64_t m, std::int64_t n, std::int64_t k, dtype t, layout_kind ka,
                  layout_kind kb, layout_kind kc, double alpha, double beta) {
  std::mt19937 rng(static_cast<unsigned>(m * 131 + n * 17 + k));
  matrix a = make_matrix(m, k, t, ka, rng);
  matrix b = make_matrix(k, n, t, kb, rng);
  matrix c = make_matrix(m, n, t, kc == layout_kind::transposed ? layout_kind::plain : kc, rng);
  std::vector<double> c0(m * n), mag;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) c0[i * n + j] = at(c.view, i, j);
  const std::vector<double> want = reference(a.view, b.view, c0, alpha, beta, mag);
  ops::matmul(a.view, b.view, c.view, alpha, beta);
  const double eps = t == dtype::f32 ? std::numeric_limits<float>::epsilon()
                                     : std::numeric_limits<double>::epsilon();
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      const double got = at(c.view, i, j), bound = 2.0 * (k + 2) * eps * mag[i * n + j] + 1e-300;
      INFO("m " << m << " n " << n << " k " << k << " at " << i << "," << j << " dtype "
                << dtype_name(t) << " a " << a.view.describe() << " b " << b.view.describe());
      REQUIRE(std::abs(got - want[i * n + j]) <= bound);
    }
}

// Sets or unsets an environment variable for the life of the object.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) old_ = v;
    if (value != nullptr)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~scoped_env() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Makes OpenBLAS pick its core again from the current environment, as it does when it loads.
void reload_openblas_core() {
  gotoblas_dynamic_quit();
  gotoblas_dynamic_init();
}

}  // namespace

TEST_CASE("matmul matches a double loop for all transpose combinations", "[cpu]") {
  const layout_kind kinds[] = {layout_kind::plain, layout_kind::transposed};
  for (dtype t : {dtype::f32, dtype::f64})
    for (layout_kind ka : kinds)
      for (layout_kind kb : kinds) {
        check_matmul(1, 1, 1, t, ka, kb, layout_kind::plain, 1.0, 0.0);
        check_matmul(17, 33, 65, t, ka, kb, layout_kind::plain, 1.0, 0.0);
        check_matmul(64, 48, 80, t, ka, kb, layout_kind::plain, -0.5, 0.75);
        check_matmul(3, 1, 9, t, ka, kb, layout_kind::plain, 2.0, 1.0);
        check_matmul(1, 7, 5, t, ka, kb, layout_kind::plain, 1.0, 1.0);
      }
}

TEST_CASE("matmul handles leading-dimension strides of sliced operands", "[cpu]") {
  for (dtype t : {dtype::f32, dtype::f64}) {
    check_matmul(17, 33, 65, t, layout_kind::padded, layout_kind::padded, layout_kind::padded, 1.5,
                 -1.0);
    check_matmul(33, 17, 9, t, layout_kind::padded, layout_kind::transposed, layout_kind::padded,
                 1.0, 0.5);
    check_matmul(5, 70, 31, t, layout_kind::transposed, layout_kind::padded, layout_kind::padded,
                 1.0, 0.0);
  }
}

TEST_CASE("matmul with beta zero ignores what c held", "[cpu]") {
  std::vector<float> a = {1, 2, 3, 4}, b = {5, 6, 7, 8};
  std::vector<float> c(4, std::numeric_limits<float>::quiet_NaN());
  tensor ta(a.data(), 16, dtype::f32, {2, 2}), tb(b.data(), 16, dtype::f32, {2, 2}),
      tc(c.data(), 16, dtype::f32, {2, 2});
  ops::matmul(ta, tb, tc);
  REQUIRE(c[0] == 19.0f);
  REQUIRE(c[1] == 22.0f);
  REQUIRE(c[2] == 43.0f);
  REQUIRE(c[3] == 50.0f);
}

TEST_CASE("matmul with an empty inner dimension scales c by beta", "[cpu]") {
  std::vector<double> a(1), b(1), c = {1, 2, 3, 4, 5, 6};
  tensor ta = tensor::strided(a.data(), 8, dtype::f64, {2, 0}, {1, 1}, 0);
  tensor tb = tensor::strided(b.data(), 8, dtype::f64, {0, 3}, {3, 1}, 0);
  tensor tc(c.data(), 48, dtype::f64, {2, 3});
  ops::matmul(ta, tb, tc, 1.0, 0.5);
  REQUIRE(c[0] == 0.5);
  REQUIRE(c[5] == 3.0);
  ops::matmul(ta, tb, tc, 1.0, 0.0);
  REQUIRE(c[5] == 0.0);
}

TEST_CASE("matmul rejects bad arguments with clear errors", "[cpu]") {
  auto a = zeros({4, 3}), b = zeros({3, 5}), c = zeros({4, 5}), b_bad = zeros({4, 5});
  REQUIRE_THROWS_WITH(ops::matmul(a, b_bad, c), Catch::Contains("inner dimensions differ"));
  auto c64 = zeros({4, 5}, dtype::f64);
  REQUIRE_THROWS_WITH(ops::matmul(a, b, c64), Catch::Contains("matmul"));
  auto a16 = zeros({4, 3}, dtype::bf16), b16 = zeros({3, 5}, dtype::bf16),
       c16 = zeros({4, 5}, dtype::bf16);
  REQUIRE_THROWS_WITH(ops::matmul(a16, b16, c), Catch::Contains("c has dtype f32 but a has bf16"));
  REQUIRE_THROWS_WITH(ops::matmul(a16, b, c16), Catch::Contains("b has dtype f32 but a has bf16"));
  // Rows that overlap (stride 1 in both dimensions) have no BLAS layout.
  std::vector<float> buf(16);
  tensor overlap = tensor::strided(buf.data(), 64, dtype::f32, {3, 4}, {1, 1}, 0);
  auto b4 = zeros({4, 5}), c3 = zeros({3, 5});
  REQUIRE_THROWS_WITH(ops::matmul(overlap, b4, c3), Catch::Contains("no BLAS layout"));
}

TEST_CASE("core selection moves a Haswell OpenBLAS onto AVX-512 kernels", "[cpu]") {
  if (gotoblas_dynamic_init == nullptr) {
    WARN("OpenBLAS without DYNAMIC_ARCH: nothing to select");
    return;
  }
  {
    scoped_env coretype("OPENBLAS_CORETYPE", "Haswell");
    scoped_env keep("TROUPE_KEEP_OPENBLAS_CORETYPE", nullptr);
    reload_openblas_core();
    REQUIRE(cpu::blas_core() == "Haswell");
    const cpu::blas_core_choice c = cpu::select_blas_core();
    INFO(c.reason);
    REQUIRE(c.before == "Haswell");
    REQUIRE(std::string(std::getenv("OPENBLAS_CORETYPE")) == "Haswell");  // restored
    if (cpu::cpu_has_avx512()) {
      REQUIRE(c.overridden);
      REQUIRE(cpu::is_avx512_core(c.after));
      REQUIRE(cpu::is_avx512_core(cpu::blas_core()));
    } else {
      REQUIRE(c.after == "Haswell");
    }
  }
  {
    scoped_env coretype("OPENBLAS_CORETYPE", "Haswell");
    scoped_env keep("TROUPE_KEEP_OPENBLAS_CORETYPE", "1");
    reload_openblas_core();
    const cpu::blas_core_choice c = cpu::select_blas_core();
    REQUIRE_FALSE(c.overridden);
    REQUIRE(cpu::blas_core() == "Haswell");
  }
  // Leave OpenBLAS on the best core for the rest of the tests.
  cpu::select_blas_core();
  check_matmul(17, 33, 65, dtype::f32, layout_kind::plain, layout_kind::transposed,
               layout_kind::plain, 1.0, 0.0);
}

// Run by the next test in a child process whose environment sets OPENBLAS_CORETYPE=Haswell, so that
// the first matmul of the process is the one that selects the core.
TEST_CASE("child: the first matmul selects an AVX-512 core", "[.][cpu-child]") {
  REQUIRE(std::string(std::getenv("OPENBLAS_CORETYPE")) == "Haswell");
  check_matmul(17, 33, 65, dtype::f32, layout_kind::plain, layout_kind::plain, layout_kind::plain,
               1.0, 0.0);
  const cpu::blas_core_choice& c = cpu::ensure_blas_core();
  INFO(c.reason);
  REQUIRE(c.before == "Haswell");
  REQUIRE(cpu::is_avx512_core(c.after));
  REQUIRE(cpu::is_avx512_core(cpu::blas_core()));
  REQUIRE(std::string(std::getenv("OPENBLAS_CORETYPE")) == "Haswell");
}

TEST_CASE("with OPENBLAS_CORETYPE=Haswell set at start the first matmul runs AVX-512 kernels",
          "[cpu]") {
  if (gotoblas_dynamic_init == nullptr || !cpu::cpu_has_avx512()) {
    WARN("no DYNAMIC_ARCH OpenBLAS or no AVX-512 CPU: nothing to select");
    return;
  }
  char exe[] = "/proc/self/exe";
  char name[] = "child: the first matmul selects an AVX-512 core";
  char* argv[] = {exe, name, nullptr};
  std::vector<std::string> env_strings = {"OPENBLAS_CORETYPE=Haswell"};
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string s(*e);
    if (s.rfind("OPENBLAS_CORETYPE=", 0) != 0 && s.rfind("TROUPE_KEEP_OPENBLAS_CORETYPE=", 0) != 0)
      env_strings.push_back(s);
  }
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, exe, nullptr, nullptr, argv, envp.data()) == 0);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
}
