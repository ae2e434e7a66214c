#include "tensor/tensor.hpp"

#include <cstring>
#include <sstream>

#include "memory/error.hpp"
#include "memory/gpu.hpp"
#include "tensor/ops.hpp"

namespace troupe {

std::string to_string(device d) {
  return d.is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

shape::shape(std::initializer_list<std::int64_t> dims) {
  TROUPE_CHECK(dims.size() <= max_dims, "shape: at most ", max_dims, " dimensions, got ",
               dims.size());
  for (auto v : dims) d_[n_++] = v;
}
shape shape::of_rank(int n) {
  TROUPE_CHECK(n >= 0 && n <= max_dims, "shape: rank ", n, " out of range");
  shape s;
  s.n_ = n;
  return s;
}
std::int64_t shape::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < n_; ++i) n *= d_[i];
  return n;
}
void shape::push_back(std::int64_t v) {
  TROUPE_CHECK(n_ < max_dims, "shape: at most ", max_dims, " dimensions");
  d_[n_++] = v;
}
void shape::erase(int i) {
  for (int j = i; j + 1 < n_; ++j) d_[j] = d_[j + 1];
  --n_;
}
bool shape::operator==(const shape& o) const {
  if (n_ != o.n_) return false;
  for (int i = 0; i < n_; ++i)
    if (d_[i] != o.d_[i]) return false;
  return true;
}
std::string shape::str() const {
  std::string s = "[";
  for (int i = 0; i < n_; ++i) s += (i ? ", " : "") + std::to_string(d_[i]);
  return s + "]";
}

namespace {
shape contiguous_strides(const shape& sizes) {
  shape st = shape::of_rank(sizes.rank());
  std::int64_t acc = 1;
  for (int i = sizes.rank() - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= sizes[i];
  }
  return st;
}
}  // namespace

tensor::tensor(void* base, std::size_t capacity_bytes, dtype t, const shape& sizes, device dev)
    : base_(base),
      capacity_(capacity_bytes),
      dtype_(t),
      sizes_(sizes),
      strides_(contiguous_strides(sizes)),
      dev_(dev) {
  validate();
}

tensor tensor::strided(void* base, std::size_t capacity_bytes, dtype t, const shape& sizes,
                       const shape& strides, std::int64_t offset, device dev) {
  TROUPE_CHECK(sizes.rank() == strides.rank(), "tensor: sizes ", sizes.str(), " and strides ",
               strides.str(), " differ in rank");
  tensor x;
  x.base_ = base;
  x.capacity_ = capacity_bytes;
  x.dtype_ = t;
  x.sizes_ = sizes;
  x.strides_ = strides;
  x.offset_ = offset;
  x.dev_ = dev;
  x.validate();
  return x;
}

void tensor::validate() const {
  TROUPE_CHECK(base_ != nullptr || numel() == 0, "tensor: null base pointer for ", describe());
  std::int64_t hi = offset_;
  TROUPE_CHECK(offset_ >= 0, "tensor: negative offset in ", describe());
  for (int i = 0; i < dim(); ++i) {
    TROUPE_CHECK(sizes_[i] >= 0, "tensor: negative extent in ", describe());
    TROUPE_CHECK(strides_[i] >= 0, "tensor: negative stride in ", describe());
    if (sizes_[i] == 0) return;
    hi += (sizes_[i] - 1) * strides_[i];
  }
  TROUPE_CHECK(static_cast<std::size_t>(hi + 1) * element_size() <= capacity_ || numel() == 0,
               "tensor: ", describe(), " reaches element ", hi, " beyond its buffer of ", capacity_,
               " bytes");
}

int tensor::norm_dim(int d, int rank_plus) const {
  int r = dim() + rank_plus;
  int n = d < 0 ? d + r : d;
  TROUPE_CHECK(n >= 0 && n < r, "tensor: dimension ", d, " out of range for ", describe());
  return n;
}

std::int64_t tensor::size(int d) const {
  return sizes_[norm_dim(d)];
}
std::int64_t tensor::stride(int d) const {
  return strides_[norm_dim(d)];
}

bool tensor::is_contiguous() const {
  std::int64_t acc = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (sizes_[i] != 1 && strides_[i] != acc) return false;
    acc *= sizes_[i];
  }
  return true;
}

tensor tensor::slice(int d, std::int64_t start, std::int64_t end, std::int64_t step) const {
  d = norm_dim(d);
  TROUPE_CHECK(step >= 1, "slice: step must be >= 1, got ", step);
  TROUPE_CHECK(0 <= start && start <= end && end <= sizes_[d], "slice: range [", start, ", ", end,
               ") out of bounds for dimension ", d, " of ", describe());
  tensor v = *this;
  v.offset_ += start * strides_[d];
  v.sizes_[d] = (end - start + step - 1) / step;
  v.strides_[d] *= step;
  return v;
}

tensor tensor::narrow(int d, std::int64_t start, std::int64_t length) const {
  return slice(d, start, start + length);
}

tensor tensor::select(int d, std::int64_t index) const {
  d = norm_dim(d);
  TROUPE_CHECK(index >= 0 && index < sizes_[d], "select: index ", index,
               " out of bounds for dimension ", d, " of ", describe());
  tensor v = *this;
  v.offset_ += index * strides_[d];
  v.sizes_.erase(d);
  v.strides_.erase(d);
  return v;
}

tensor tensor::transpose(int a, int b) const {
  a = norm_dim(a);
  b = norm_dim(b);
  tensor v = *this;
  std::swap(v.sizes_[a], v.sizes_[b]);
  std::swap(v.strides_[a], v.strides_[b]);
  return v;
}

tensor tensor::reshape(const shape& sizes) const {
  TROUPE_CHECK(is_contiguous(), "reshape: needs a contiguous tensor, got ", describe());
  shape s = sizes;
  int infer = -1;
  std::int64_t known = 1;
  for (int i = 0; i < s.rank(); ++i) {
    if (s[i] == -1) {
      TROUPE_CHECK(infer < 0, "reshape: more than one -1 in ", sizes.str());
      infer = i;
    } else {
      TROUPE_CHECK(s[i] >= 0, "reshape: negative extent in ", sizes.str());
      known *= s[i];
    }
  }
  if (infer >= 0) {
    TROUPE_CHECK(known > 0 && numel() % known == 0, "reshape: cannot infer -1 in ", sizes.str(),
                 " from ", describe());
    s[infer] = numel() / known;
  }
  TROUPE_CHECK(s.numel() == numel(), "reshape: ", s.str(), " has ", s.numel(),
               " elements but the tensor ", describe(), " has ", numel());
  tensor v = *this;
  v.sizes_ = s;
  v.strides_ = contiguous_strides(s);
  return v;
}

tensor tensor::unsqueeze(int d) const {
  d = norm_dim(d, 1);
  tensor v = *this;
  shape sz = shape::of_rank(0), st = shape::of_rank(0);
  for (int i = 0, j = 0; i < dim() + 1; ++i) {
    if (i == d) {
      sz.push_back(1);
      st.push_back(d < dim() ? sizes_[d] * strides_[d] : 1);
    } else {
      sz.push_back(sizes_[j]);
      st.push_back(strides_[j]);
      ++j;
    }
  }
  v.sizes_ = sz;
  v.strides_ = st;
  return v;
}

std::string tensor::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype_) << sizes_.str();
  if (!is_contiguous()) os << " strides " << strides_.str();
  os << " on " << to_string(dev_);
  return os.str();
}

void tensor::check_type(dtype want) const {
  TROUPE_CHECK(dtype_ == want, "tensor: expected dtype ", dtype_name(want), ", got ", describe());
}

owned_tensor::owned_tensor(memory::buffer buf, dtype t, const shape& sizes, device dev)
    : tensor(buf.data(), buf.size(), t, sizes, dev), buf_(std::move(buf)) {}

owned_tensor empty(const shape& sizes, dtype t, device dev) {
  for (auto s : sizes) TROUPE_CHECK(s >= 0, "empty: negative extent in ", sizes.str());
  std::size_t bytes = static_cast<std::size_t>(sizes.numel()) * dtype_size(t);
  memory::buffer b = dev.is_cpu() ? memory::buffer::host(bytes) : memory::buffer::device(bytes);
  return owned_tensor(std::move(b), t, sizes, dev);
}

owned_tensor zeros(const shape& sizes, dtype t, device dev) {
  auto x = empty(sizes, t, dev);
  ops::fill(x, 0.0);
  return x;
}

owned_tensor to_device(const tensor& src, device dev) {
  auto out = empty(src.sizes(), src.type(), dev);
  if (src.is_cpu() && dev.is_cpu()) {
    ops::copy(src, out);
    return out;
  }
  TROUPE_CHECK(src.is_contiguous(),
               "to_device: a copy between devices needs a contiguous source, got ", src.describe());
  using memory::copy_kind;
  copy_kind k = src.is_cpu()   ? copy_kind::host_to_device
                : dev.is_cpu() ? copy_kind::device_to_host
                               : copy_kind::device_to_device;
  memory::copy_bytes(out.data(), src.data(), src.nbytes(), k);
  return out;
}

}  // namespace troupe
