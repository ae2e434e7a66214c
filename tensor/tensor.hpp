// tensor: a small non-owning descriptor over bytes an allocator owns (ggml-style).
//
// A tensor is (base pointer, capacity in bytes, dtype, shape, strides in elements, offset in
// elements, device). Views (slice, narrow, select, transpose, reshape) make a new descriptor over
// the same bytes and never copy; every view is checked to stay inside the capacity, so a bad
// stride or range is an error naming the shape, not a stray read. owned_tensor couples a descriptor
// with the memory::buffer it describes, for code that wants a tensor with its own storage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "memory/buffer.hpp"
#include "tensor/dtype.hpp"

namespace troupe {

enum class device_kind : std::uint8_t { cpu, cuda };

struct device {
  device_kind kind = device_kind::cpu;
  int index = 0;
  static constexpr device cpu() { return {}; }
  static constexpr device cuda(int i = 0) { return {device_kind::cuda, i}; }
  bool is_cpu() const { return kind == device_kind::cpu; }
  bool operator==(const device&) const = default;
};
std::string to_string(device d);

inline constexpr int max_dims = 6;

// A fixed-capacity list of up to max_dims extents (or strides).
class shape {
 public:
  shape() = default;
  shape(std::initializer_list<std::int64_t> dims);
  static shape of_rank(int n);  // n zeros
  int rank() const { return n_; }
  std::int64_t& operator[](int i) { return d_[i]; }
  std::int64_t operator[](int i) const { return d_[i]; }
  std::int64_t numel() const;
  const std::int64_t* begin() const { return d_; }
  const std::int64_t* end() const { return d_ + n_; }
  void push_back(std::int64_t v);
  void erase(int i);
  bool operator==(const shape& o) const;
  std::string str() const;  // "[2, 3, 4]"

 private:
  std::int64_t d_[max_dims] = {};
  int n_ = 0;
};

class tensor {
 public:
  tensor() = default;
  // A contiguous (row-major) tensor over [base, base + capacity_bytes).
  tensor(void* base, std::size_t capacity_bytes, dtype t, const shape& sizes,
         device dev = device::cpu());
  // A general strided view; validated to stay within capacity.
  static tensor strided(void* base, std::size_t capacity_bytes, dtype t, const shape& sizes,
                        const shape& strides, std::int64_t offset, device dev = device::cpu());

  bool defined() const { return base_ != nullptr; }
  dtype type() const { return dtype_; }
  device dev() const { return dev_; }
  bool is_cpu() const { return dev_.is_cpu(); }
  int dim() const { return sizes_.rank(); }
  std::int64_t size(int d) const;    // negative d counts from the end
  std::int64_t stride(int d) const;  // in elements
  const shape& sizes() const { return sizes_; }
  const shape& strides() const { return strides_; }
  std::int64_t offset() const { return offset_; }  // in elements, from base
  std::int64_t numel() const { return sizes_.numel(); }
  std::size_t element_size() const { return dtype_size(dtype_); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(); }
  bool is_contiguous() const;
  bool last_dim_contiguous() const {
    return dim() == 0 || sizes_[dim() - 1] <= 1 || strides_[dim() - 1] == 1;
  }

  void* data() const {
    return static_cast<char*>(base_) + offset_ * static_cast<std::int64_t>(element_size());
  }
  template <class T>
  T* data_as() const {
    check_type(dtype_of<T>);
    return static_cast<T*>(data());
  }
  void* base() const { return base_; }
  std::size_t capacity() const { return capacity_; }

  // Views: no copies.
  tensor slice(int d, std::int64_t start, std::int64_t end, std::int64_t step = 1) const;
  tensor narrow(int d, std::int64_t start, std::int64_t length) const;
  tensor select(int d, std::int64_t index) const;  // removes dimension d
  tensor transpose(int a, int b) const;
  tensor reshape(const shape& sizes) const;  // needs a contiguous tensor; one extent may be -1
  tensor unsqueeze(int d) const;

  std::string describe() const;  // e.g. "f32[4, 8] strides [8, 1] on cpu"
  void check_type(dtype want) const;

 private:
  int norm_dim(int d, int rank_plus = 0) const;
  void validate() const;

  void* base_ = nullptr;
  std::size_t capacity_ = 0;
  dtype dtype_ = dtype::f32;
  shape sizes_;
  shape strides_;
  std::int64_t offset_ = 0;
  device dev_{};
};

// A tensor that owns its storage. Moving it keeps data() valid (the bytes do not move).
class owned_tensor : public tensor {
 public:
  owned_tensor() = default;
  owned_tensor(memory::buffer buf, dtype t, const shape& sizes, device dev);
  owned_tensor(owned_tensor&&) noexcept = default;
  owned_tensor& operator=(owned_tensor&&) noexcept = default;
  const tensor& view() const { return *this; }
  const memory::buffer& storage() const { return buf_; }

 private:
  memory::buffer buf_;
};

// Uninitialized storage on a device (host memory for cpu, device memory for cuda).
owned_tensor empty(const shape& sizes, dtype t = dtype::f32, device dev = device::cpu());
owned_tensor zeros(const shape& sizes, dtype t = dtype::f32, device dev = device::cpu());
// A contiguous copy of src on dev (any device pair; src need not be contiguous on cpu).
owned_tensor to_device(const tensor& src, device dev);

}  // namespace troupe
