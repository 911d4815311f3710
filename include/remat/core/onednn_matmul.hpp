#pragma once
// oneDNN's matmul primitive, made once per product shape and reused: the engine remat's bfloat16
// products run on (core/gemm.hpp). The primitive dispatches at run time to the best kernel the CPU
// has (AMX tiles, else AVX512-BF16, else AVX2 conversions), which the undocumented
// dnnl_gemm_bf16bf16f32 reaches only for some shapes; but making one (its descriptor, the kernel's
// blocking, the JIT) costs tens of microseconds to milliseconds, far more than a small product, so
// every product looks its primitive up in a cache keyed by everything the primitive was made for:
// element types, batch, shapes, strides (transposes are strides), accumulation and the thread
// count it will run on. Same key, same primitive, same kernel and blocking: the same bits.
//
// The cache is per thread (products run on worker threads inside parallel regions — the fused
// attention's per-head products, gemm_pair's halves — and a per-thread cache needs no lock on the
// hit path); each thread's scratch space is its own too (user scratchpad mode), so two threads
// never share a primitive's buffers. A key that oneDNN rejects, or answers with a reference kernel
// or with its gemm wrapped (strided operands), is remembered as such and answered by the caller's
// fallback every time (MatmulPrimitive::usable), so a shape never changes path within a process.

#ifdef REMAT_WITH_ONEDNN

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "remat/core/error.hpp"

namespace remat::detail {

/// One strided operand of a (batched) row-major product: element (b, i, j) at b·batch + i·row + j·col.
struct MatmulOperand {
  std::int64_t batch = 0, row = 0, col = 1;
};

/// Everything a matmul primitive is made for.
struct MatmulKey {
  dnnl_data_type_t in_type = dnnl_f32;  // A's and B's
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  MatmulOperand a, b, c;
  bool accumulate = false;
  int threads = 1;

  bool operator==(const MatmulKey& o) const {
    return in_type == o.in_type && batch == o.batch && m == o.m && n == o.n && k == o.k && a.batch == o.a.batch &&
           a.row == o.a.row && a.col == o.a.col && b.batch == o.b.batch && b.row == o.b.row && b.col == o.b.col &&
           c.batch == o.c.batch && c.row == o.c.row && accumulate == o.accumulate && threads == o.threads;
  }
};

struct MatmulKeyHash {
  std::size_t operator()(const MatmulKey& key) const {
    const std::array<std::int64_t, 15> words{key.in_type, key.batch, key.m,       key.n,       key.k,
                                             key.a.batch, key.a.row, key.a.col,   key.b.batch, key.b.row,
                                             key.b.col,   key.c.batch, key.c.row, key.accumulate, key.threads};
    std::uint64_t h = 1469598103934665603ull;
    for (const std::int64_t w : words) h = (h ^ static_cast<std::uint64_t>(w)) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};

/// A oneDNN status as the error names it.
inline const char* dnnl_status_name(dnnl_status_t s) {
  switch (s) {
    case dnnl_success: return "success";
    case dnnl_out_of_memory: return "out_of_memory";
    case dnnl_invalid_arguments: return "invalid_arguments";
    case dnnl_unimplemented: return "unimplemented";
    case dnnl_iterator_ends: return "iterator_ends";
    case dnnl_runtime_error: return "runtime_error";
    case dnnl_not_required: return "not_required";
    default: return "unknown";
  }
}

/// RAII around every oneDNN product (dnnl_sgemm, dnnl_gemm_bf16bf16f32, a matmul primitive made
/// or run): the calling thread's OpenMP dynamic adjustment off and its team size capped by
/// OMP_THREAD_LIMIT while it lives. oneDNN 2.6 splits a product for omp_get_max_threads() threads
/// and leaves the pieces of threads a region did not get unwritten: under OMP_DYNAMIC=true (libgomp
/// shrinks teams by the load average) or OMP_THREAD_LIMIT below OMP_NUM_THREADS, a 128×96×80
/// sgemm on 2 threads came back wrong by up to 3.9 where its error is 3e-6. With the team size
/// fixed, the region gets the threads the split was made for.
class OnednnTeam {
 public:
  OnednnTeam() {
#ifdef _OPENMP
    if (dynamic_) omp_set_dynamic(0);
    const int limit = omp_get_thread_limit();
    if (limit < threads_) set_threads(std::max(limit, 1));
#endif
  }
  /// A team of `threads` instead (a primitive made for that many).
  explicit OnednnTeam(int threads) : OnednnTeam() {
#ifdef _OPENMP
    if (threads != omp_get_max_threads()) set_threads(threads);
#else
    static_cast<void>(threads);
#endif
  }
  ~OnednnTeam() {  // only what was changed is put back: the hit path stays a few reads
#ifdef _OPENMP
    if (dynamic_) omp_set_dynamic(1);
    if (changed_threads_) omp_set_num_threads(threads_);
#endif
  }
  OnednnTeam(const OnednnTeam&) = delete;
  OnednnTeam& operator=(const OnednnTeam&) = delete;

 private:
#ifdef _OPENMP
  void set_threads(int n) {
    omp_set_num_threads(n);
    changed_threads_ = true;
  }
  bool dynamic_ = omp_get_dynamic() != 0;
  int threads_ = omp_get_max_threads();
  bool changed_threads_ = false;
#endif
};

/// The thread count a product issued here and now runs on under OnednnTeam, which its primitive
/// is made for: one inside a parallel region (oneDNN does not nest), else the OpenMP team size
/// capped by OMP_THREAD_LIMIT.
inline int matmul_threads() {
#ifdef _OPENMP
  if (omp_in_parallel()) return 1;
  return std::max(1, std::min(omp_get_max_threads(), omp_get_thread_limit()));
#else
  return 1;
#endif
}

/// The CPU engine and this thread's stream.
class OnednnContext {
 public:
  static dnnl_engine_t engine() {
    static const std::unique_ptr<dnnl_engine, EngineDeleter> engine = [] {
      dnnl_engine_t e = nullptr;
      const dnnl_status_t s = dnnl_engine_create(&e, dnnl_cpu, 0);
      REMAT_CHECK(s == dnnl_success, "matmul: oneDNN's CPU engine could not be made (status {})", dnnl_status_name(s));
      return std::unique_ptr<dnnl_engine, EngineDeleter>(e);
    }();
    return engine.get();
  }
  static dnnl_stream_t stream() {
    thread_local const std::unique_ptr<dnnl_stream, StreamDeleter> stream = [] {
      dnnl_stream_t s = nullptr;
      const dnnl_status_t status = dnnl_stream_create(&s, engine(), dnnl_stream_default_flags);
      REMAT_CHECK(status == dnnl_success, "matmul: oneDNN stream could not be made (status {})", dnnl_status_name(status));
      return std::unique_ptr<dnnl_stream, StreamDeleter>(s);
    }();
    return stream.get();
  }

 private:
  struct EngineDeleter {
    void operator()(dnnl_engine_t e) const { dnnl_engine_destroy(e); }
  };
  struct StreamDeleter {
    void operator()(dnnl_stream_t s) const { dnnl_stream_destroy(s); }
  };
};

/// One product's primitive with its memory objects (their data pointers set at every call).
class MatmulPrimitive {
 public:
  static constexpr std::size_t kScratchAlignment = 4096;

  /// Makes the primitive for `key`; usable() is false where oneDNN has none or only a reference
  /// kernel (`reason` says which).
  explicit MatmulPrimitive(const MatmulKey& key) {
    const OnednnTeam team(key.threads);  // oneDNN sizes the primitive's split by this thread's count
    const int nd = key.batch > 1 ? 3 : 2;
    auto desc = [&](dnnl_data_type_t type, std::int64_t rows, std::int64_t cols, const MatmulOperand& op) {
      dnnl_memory_desc_t md;
      dnnl_dims_t dims{}, strides{};
      if (nd == 3) {
        dims[0] = key.batch, dims[1] = rows, dims[2] = cols;
        strides[0] = op.batch, strides[1] = op.row, strides[2] = op.col;
      } else {
        dims[0] = rows, dims[1] = cols;
        strides[0] = op.row, strides[1] = op.col;
      }
      check(dnnl_memory_desc_init_by_strides(&md, nd, dims, type, strides), key, "memory descriptor");
      return md;
    };
    const dnnl_memory_desc_t a = desc(key.in_type, key.m, key.k, key.a), b = desc(key.in_type, key.k, key.n, key.b),
                             c = desc(dnnl_f32, key.m, key.n, key.c);
    dnnl_matmul_desc_t op;
    check(dnnl_matmul_desc_init(&op, &a, &b, nullptr, &c), key, "matmul descriptor");

    dnnl_primitive_attr_t attr = nullptr;
    check(dnnl_primitive_attr_create(&attr), key, "attributes");
    Owned<dnnl_primitive_attr, &dnnl_primitive_attr_destroy> attr_owner(attr);
    check(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), key, "scratchpad mode");
    if (key.accumulate) {  // C += A B: the sum post-op, scale 1
      dnnl_post_ops_t post = nullptr;
      check(dnnl_post_ops_create(&post), key, "post-ops");
      Owned<dnnl_post_ops, &dnnl_post_ops_destroy> post_owner(post);
      check(dnnl_post_ops_append_sum(post, 1.0f), key, "sum post-op");
      check(dnnl_primitive_attr_set_post_ops(attr, post), key, "post-ops");
    }

    dnnl_primitive_desc_t pd = nullptr;
    const dnnl_status_t made = dnnl_primitive_desc_create(&pd, &op, attr, OnednnContext::engine(), nullptr);
    if (made == dnnl_unimplemented) {
      reason_ = "oneDNN has no matmul for these shapes and strides";
      return;
    }
    check(made, key, "primitive descriptor");
    Owned<dnnl_primitive_desc, &dnnl_primitive_desc_destroy> pd_owner(pd);
    const char* impl = nullptr;
    check(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl), key, "implementation name");
    impl_ = impl ? impl : "";
    if (impl_.rfind("ref", 0) == 0) {  // a reference loop: slower than the caller's fallback
      reason_ = "oneDNN's only matmul here is its reference kernel (" + impl_ + ")";
      return;
    }
    // oneDNN 2.6's brgemm kernels take dense operands only; with longer rows (a head's slice of
    // q, k, v) it wraps the gemm the caller's fallback calls directly, so that is called instead.
    if (impl_.rfind("gemm", 0) == 0) {
      reason_ = "oneDNN's matmul here wraps its gemm (" + impl_ + "), which the caller calls directly";
      return;
    }
    scratch_bytes_ = dnnl_memory_desc_get_size(dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0));
    dnnl_primitive_t prim = nullptr;
    check(dnnl_primitive_create(&prim, pd), key, "primitive");
    primitive_.reset(prim);
    auto memory = [&](const dnnl_memory_desc_t& md, Owned<dnnl_memory, &dnnl_memory_destroy>& out) {
      dnnl_memory_t mem = nullptr;
      check(dnnl_memory_create(&mem, &md, OnednnContext::engine(), DNNL_MEMORY_NONE), key, "memory");
      out.reset(mem);
    };
    memory(a, a_);
    memory(b, b_);
    memory(c, c_);
    if (scratch_bytes_ > 0) memory(*dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0), scratch_);
  }

  bool usable() const { return primitive_ != nullptr; }
  /// oneDNN's name for the kernel (e.g. "brg:avx512_core_amx_bf16"), or why there is none.
  const std::string& implementation() const { return impl_; }
  const std::string& reason() const { return reason_; }

  /// Runs the product on these buffers (the shapes and strides are the key's).
  void run(const void* a, const void* b, float* c, const MatmulKey& key) const {
    // This thread's scratch space, page-aligned as oneDNN aligns the scratchpads it allocates
    // itself (it carves aligned buffers out of one, counting from its start).
    struct Scratch {
      std::unique_ptr<unsigned char, void (*)(unsigned char*)> bytes{nullptr, [](unsigned char* p) {
        ::operator delete(p, std::align_val_t{kScratchAlignment});
      }};
      std::size_t size = 0;
    };
    thread_local Scratch scratch;
    if (scratch.size < scratch_bytes_) {
      scratch.bytes.reset(static_cast<unsigned char*>(::operator new(scratch_bytes_, std::align_val_t{kScratchAlignment})));
      scratch.size = scratch_bytes_;
    }
    check(dnnl_memory_set_data_handle(a_.get(), const_cast<void*>(a)), key, "operand A");
    check(dnnl_memory_set_data_handle(b_.get(), const_cast<void*>(b)), key, "operand B");
    check(dnnl_memory_set_data_handle(c_.get(), c), key, "result C");
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, a_.get()}, {DNNL_ARG_WEIGHTS, b_.get()}, {DNNL_ARG_DST, c_.get()},
                               {DNNL_ARG_SCRATCHPAD, scratch_.get()}};
    if (scratch_) check(dnnl_memory_set_data_handle(scratch_.get(), scratch.bytes.get()), key, "scratchpad");
    dnnl_stream_t stream = OnednnContext::stream();
    const OnednnTeam team;
    check(dnnl_primitive_execute(primitive_.get(), stream, scratch_ ? 4 : 3, args), key, "execution");
  }

 private:
  template <class T, dnnl_status_t (*destroy)(T*)>
  struct Owned : std::unique_ptr<T, void (*)(T*)> {
    explicit Owned(T* p = nullptr) : std::unique_ptr<T, void (*)(T*)>(p, [](T* q) { if (q) destroy(q); }) {}
  };

  static void check(dnnl_status_t s, const MatmulKey& key, const char* what) {
    REMAT_CHECK(s == dnnl_success,
                "matmul: oneDNN failed at the {} ({}) for a {} product of batch {}, m={}, n={}, k={}, strides A "
                "[{}, {}, {}], B [{}, {}, {}], C [{}, {}]{}",
                what, dnnl_status_name(s), key.in_type == dnnl_bf16 ? "bfloat16" : "float32", key.batch, key.m, key.n,
                key.k, key.a.batch, key.a.row, key.a.col, key.b.batch, key.b.row, key.b.col, key.c.batch, key.c.row,
                key.accumulate ? ", accumulating" : "");
  }

  Owned<dnnl_primitive, &dnnl_primitive_destroy> primitive_;
  Owned<dnnl_memory, &dnnl_memory_destroy> a_, b_, c_, scratch_;
  std::size_t scratch_bytes_ = 0;
  std::string impl_, reason_;
};

/// This thread's primitives, one per key, made at first use and kept for the thread's life.
class MatmulCache {
 public:
  static MatmulCache& local() {
    thread_local MatmulCache cache;
    return cache;
  }

  /// The primitive for key (made now if this thread has none yet).
  const MatmulPrimitive& get(const MatmulKey& key) {
    if (last_ && last_key_ == key) return *last_;  // a layer's products come in runs of one shape
    auto it = entries_.find(key);
    if (it == entries_.end()) it = entries_.emplace(key, std::make_unique<MatmulPrimitive>(key)).first;
    last_key_ = key;
    last_ = it->second.get();
    return *last_;
  }

  std::size_t size() const { return entries_.size(); }

 private:
  std::unordered_map<MatmulKey, std::unique_ptr<MatmulPrimitive>, MatmulKeyHash> entries_;
  MatmulKey last_key_;
  const MatmulPrimitive* last_ = nullptr;
};

/// The key of a row-major product C (m×n, ldc) = or += op(A) · op(B), A and B as stored with
/// leading dimensions lda and ldb, batched `batch` times at the given strides between matrices.
inline MatmulKey matmul_key(dnnl_data_type_t in_type, bool trans_a, bool trans_b, std::int64_t batch, std::int64_t m,
                            std::int64_t n, std::int64_t k, std::int64_t lda, std::int64_t stride_a, std::int64_t ldb,
                            std::int64_t stride_b, std::int64_t ldc, std::int64_t stride_c, bool accumulate) {
  MatmulKey key;
  key.in_type = in_type;
  key.batch = batch, key.m = m, key.n = n, key.k = k;
  key.a = trans_a ? MatmulOperand{stride_a, 1, lda} : MatmulOperand{stride_a, lda, 1};
  key.b = trans_b ? MatmulOperand{stride_b, 1, ldb} : MatmulOperand{stride_b, ldb, 1};
  key.c = MatmulOperand{stride_c, ldc, 1};
  if (batch == 1) key.a.batch = key.b.batch = key.c.batch = 0;  // one matrix: its stride means nothing
  key.accumulate = accumulate;
  key.threads = matmul_threads();
  return key;
}

}  // namespace remat::detail

#endif  // REMAT_WITH_ONEDNN
