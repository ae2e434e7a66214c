// The project's error type and the checks that raise it.
//
// memory/ is the bottom module, so the error type every other module uses lives here. Library code
// never calls exit() or abort(): a failed precondition (a wrong shape, a bad argument from a user)
// throws troupe::error with a message that names what is wrong and where (file:line of the check).
// Module boundaries that take user input (checkpoints, configs) return expected<T> instead.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace troupe {

class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Args>
[[noreturn]] void fail(const char* file, int line, Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  os << " [" << file << ":" << line << "]";
  throw error(os.str());
}
}  // namespace detail

// expected<T>: a value or an error message, for boundaries that take user input.
template <class T>
class expected {
 public:
  expected(T value) : v_(std::in_place_index<0>, std::move(value)) {}
  static expected failure(std::string message) { return expected(err_tag{}, std::move(message)); }
  bool has_value() const { return v_.index() == 0; }
  explicit operator bool() const { return has_value(); }
  T& value() & {
    check();
    return std::get<0>(v_);
  }
  T&& value() && {
    check();
    return std::get<0>(std::move(v_));
  }
  T& operator*() & { return value(); }
  T* operator->() { return &value(); }
  const std::string& error_message() const { return std::get<1>(v_); }

 private:
  struct err_tag {};
  expected(err_tag, std::string m) : v_(std::in_place_index<1>, std::move(m)) {}
  void check() const {
    if (v_.index() != 0) throw error(std::get<1>(v_));
  }
  std::variant<T, std::string> v_;
};

}  // namespace troupe

#define TROUPE_FAIL(...) ::troupe::detail::fail(__FILE__, __LINE__, __VA_ARGS__)
#define TROUPE_CHECK(cond, ...)                                           \
  do {                                                                    \
    if (!(cond)) ::troupe::detail::fail(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
