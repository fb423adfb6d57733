// edgeline's C ABI over ExecuTorch's C++ runtime (libexecutorch.so and the kernels and delegates the executorch
// wheel ships), so Python can run a .pte through ctypes without torch. Built by edgeline.executorch_native (at install or first use) with the
// flags ExecuTorch's cmake config names (C++17, C10_USING_CUSTOM_GENERATED_MACROS, ET_EVENT_TRACER_ENABLED,
// ET_USE_THREADPOOL, every library linked --no-as-needed so their static registrations run).
//
// Every function returns 0 (ExecuTorch's Error::Ok) or an ExecuTorch error code, and on failure writes one line to
// the caller's `err` buffer: what failed, and the runtime's own last error log lines.

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include <executorch/extension/data_loader/file_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/exec_aten/exec_aten.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/platform.h>
#include <executorch/runtime/platform/runtime.h>

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::aten::TensorImpl;
using executorch::extension::FileDataLoader;
using executorch::extension::MallocMemoryAllocator;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::HierarchicalAllocator;
using executorch::runtime::MemoryManager;
using executorch::runtime::Method;
using executorch::runtime::MethodMeta;
using executorch::runtime::Program;
using executorch::runtime::Span;

constexpr int kAbi = 1;
constexpr int kMaxDims = 16;

// The runtime's error lines since the last call that reported them (the log is per process, as
// ExecuTorch's platform layer is; a session is used from one thread at a time).
std::mutex log_mutex;
std::string log_lines;

void keep_log(et_timestamp_t, et_pal_log_level_t level, const char*, const char*, size_t, const char* message,
              size_t length) {
  if (level != kError && level != kFatal) {
    return;
  }
  std::lock_guard<std::mutex> lock(log_mutex);
  if (log_lines.size() > 2048) {
    log_lines.erase(0, log_lines.size() - 1024);
  }
  if (!log_lines.empty()) {
    log_lines += "; ";
  }
  log_lines.append(message, length);
  while (!log_lines.empty() && (log_lines.back() == '\n' || log_lines.back() == ' ')) {
    log_lines.pop_back();
  }
}

std::string take_log() {
  std::lock_guard<std::mutex> lock(log_mutex);
  std::string taken;
  taken.swap(log_lines);
  return taken;
}

int fail(Error error, const std::string& what, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    std::string line = what;
    std::string logged = take_log();
    if (!logged.empty()) {
      line += " (runtime said: " + logged + ")";
    }
    std::snprintf(err, err_len, "%s", line.c_str());
  }
  int code = static_cast<int>(error);
  return code == 0 ? static_cast<int>(Error::Internal) : code;
}

void init_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    executorch::runtime::runtime_init();
    executorch::runtime::register_pal(executorch::runtime::PalImpl::create(keep_log, __FILE__));
  });
}

// `count` names, from `name(i)` (an ExecuTorch Result<const char*>), comma-separated into `out`.
template <typename NameOf>
void write_names(size_t count, NameOf name, char* out, size_t out_len) {
  std::string names;
  for (size_t i = 0; i < count; ++i) {
    auto found = name(i);
    if (!found.ok()) {
      continue;
    }
    if (!names.empty()) {
      names += ",";
    }
    names += found.get();
  }
  std::snprintf(out, out_len, "%s", names.c_str());
}

struct Session {
  std::unique_ptr<FileDataLoader> loader;
  std::unique_ptr<Program> program;
  std::unique_ptr<MethodMeta> meta;
  MallocMemoryAllocator method_allocator;
  MallocMemoryAllocator temp_allocator;
  std::vector<std::vector<uint8_t>> planned_buffers;
  std::vector<Span<uint8_t>> planned_spans;
  std::unique_ptr<HierarchicalAllocator> planned;
  std::unique_ptr<MemoryManager> memory;
  std::unique_ptr<Method> method;
};

}  // namespace

extern "C" {

int edgeline_et_abi() { return kAbi; }

// The delegates (backends) this runtime registered, comma-separated.
int edgeline_et_registered_backends(char* out, size_t out_len) {
  init_once();
  write_names(executorch::runtime::get_num_registered_backends(),
              [](size_t i) { return executorch::runtime::get_backend_name(i); }, out, out_len);
  return 0;
}

// The thread pool's size. The wheel ships no header for ExecuTorch's thread pool (extension/threadpool/
// threadpool.h), so its three functions are looked up by their (Itanium C++ ABI) names: -1 (NotSupported) when one
// is missing, and the pool keeps the size it chose (the core count). `current` receives the size now.
int edgeline_et_set_threads(int threads, int* current) {
  init_once();
  using GetPool = void* (*)();
  using GetCount = size_t (*)(const void*);
  using Reset = bool (*)(void*, uint32_t);
  *current = 0;
  // Already loaded (the shim links it): RTLD_NOLOAD finds it by its name, RTLD_DEFAULT would not (ctypes loads the
  // shim and its libraries RTLD_LOCAL).
  void* library = dlopen("libexecutorch_threadpool.so", RTLD_LAZY | RTLD_NOLOAD);
  if (library == nullptr) {
    return static_cast<int>(Error::NotSupported);
  }
  auto get_pool = reinterpret_cast<GetPool>(dlsym(library, "_ZN10executorch9extension10threadpool14get_threadpoolEv"));
  auto get_count =
      reinterpret_cast<GetCount>(dlsym(library, "_ZNK10executorch9extension10threadpool10ThreadPool16get_thread_countEv"));
  auto reset =
      reinterpret_cast<Reset>(dlsym(library, "_ZN10executorch9extension10threadpool10ThreadPool24_unsafe_reset_threadpoolEj"));
  dlclose(library);
  if (get_pool == nullptr || get_count == nullptr || reset == nullptr) {
    return static_cast<int>(Error::NotSupported);
  }
  void* pool = get_pool();
  if (pool == nullptr) {
    return static_cast<int>(Error::NotSupported);
  }
  if (threads >= 1 && get_count(pool) != static_cast<size_t>(threads)) {
    reset(pool, static_cast<uint32_t>(threads));
  }
  *current = static_cast<int>(get_count(pool));
  return 0;
}

// Opens the program at `path` and reads `method_name`'s metadata; with load != 0 also loads the method (its planned
// memory, its delegates' initialisation), ready to run.
int edgeline_et_open(const char* path, const char* method_name, int load, void** handle, char* err, size_t err_len) {
  init_once();
  take_log();
  *handle = nullptr;
  std::unique_ptr<Session> session(new (std::nothrow) Session());
  if (!session) {
    return fail(Error::MemoryAllocationFailed, "no memory for a session", err, err_len);
  }
  auto loader = FileDataLoader::from(path);
  if (!loader.ok()) {
    return fail(loader.error(), "could not open the file", err, err_len);
  }
  session->loader = std::make_unique<FileDataLoader>(std::move(loader.get()));
  auto program = Program::load(session->loader.get(), Program::Verification::InternalConsistency);
  if (!program.ok()) {
    return fail(program.error(), "not a program this runtime can read", err, err_len);
  }
  session->program = std::make_unique<Program>(std::move(program.get()));
  auto meta = session->program->method_meta(method_name);
  if (!meta.ok()) {
    return fail(meta.error(), std::string("the program has no method '") + method_name + "'", err, err_len);
  }
  session->meta = std::make_unique<MethodMeta>(meta.get());
  if (load != 0) {
    size_t buffers = session->meta->num_memory_planned_buffers();
    session->planned_buffers.resize(buffers);
    for (size_t i = 0; i < buffers; ++i) {
      auto size = session->meta->memory_planned_buffer_size(i);
      if (!size.ok()) {
        return fail(size.error(), "the program's memory plan is unreadable", err, err_len);
      }
      session->planned_buffers[i].resize(static_cast<size_t>(size.get()));
      session->planned_spans.emplace_back(session->planned_buffers[i].data(), session->planned_buffers[i].size());
    }
    session->planned = std::make_unique<HierarchicalAllocator>(
        Span<Span<uint8_t>>(session->planned_spans.data(), session->planned_spans.size()));
    session->memory = std::make_unique<MemoryManager>(&session->method_allocator, session->planned.get(),
                                                      &session->temp_allocator);
    auto method = session->program->load_method(method_name, session->memory.get());
    if (!method.ok()) {
      return fail(method.error(), std::string("could not load method '") + method_name + "'", err, err_len);
    }
    session->method = std::make_unique<Method>(std::move(method.get()));
  }
  *handle = session.release();
  return 0;
}

void edgeline_et_close(void* handle) { delete static_cast<Session*>(handle); }

int edgeline_et_count(void* handle, int outputs) {
  auto* session = static_cast<Session*>(handle);
  return static_cast<int>(outputs ? session->meta->num_outputs() : session->meta->num_inputs());
}

// A method input's or output's dtype (ExecuTorch's ScalarType code) and shape as the program declares it (for a
// dynamic dimension: its upper bound). Non-zero when that value is not a tensor.
int edgeline_et_tensor_meta(void* handle, int outputs, int index, int* dtype, int* ndim, int64_t* sizes, char* err,
                            size_t err_len) {
  auto* session = static_cast<Session*>(handle);
  auto info = outputs ? session->meta->output_tensor_meta(static_cast<size_t>(index))
                      : session->meta->input_tensor_meta(static_cast<size_t>(index));
  if (!info.ok()) {
    return fail(info.error(), std::string(outputs ? "output " : "input ") + std::to_string(index) + " is not a tensor",
                err, err_len);
  }
  auto shape = info->sizes();
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    return fail(Error::NotSupported, "a tensor of more than 16 dimensions", err, err_len);
  }
  *dtype = static_cast<int>(info->scalar_type());
  *ndim = static_cast<int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    sizes[i] = shape[i];
  }
  return 0;
}

// The delegates the method was lowered to, comma-separated.
int edgeline_et_method_backends(void* handle, char* out, size_t out_len) {
  auto* session = static_cast<Session*>(handle);
  write_names(session->meta->num_backends(), [session](size_t i) { return session->meta->get_backend_name(i); }, out,
              out_len);
  return 0;
}

// Runs the loaded method on `count` contiguous input arrays (data, dtype code, rank, sizes: the ranks' sizes one
// after the other). The runtime copies each into its planned memory; the outputs stay the method's until the next
// run (edgeline_et_output).
int edgeline_et_run(void* handle, int count, void* const* data, const int* dtypes, const int* ndims,
                    const int64_t* sizes, char* err, size_t err_len) {
  auto* session = static_cast<Session*>(handle);
  take_log();
  if (!session->method) {
    return fail(Error::InvalidState, "the method is not loaded", err, err_len);
  }
  if (static_cast<size_t>(count) != session->method->inputs_size()) {
    return fail(Error::InvalidArgument,
                "the method takes " + std::to_string(session->method->inputs_size()) + " inputs, not " +
                    std::to_string(count),
                err, err_len);
  }
  const int64_t* next = sizes;
  for (int i = 0; i < count; ++i) {
    if (ndims[i] < 0 || ndims[i] > kMaxDims) {
      return fail(Error::InvalidArgument, "input " + std::to_string(i) + " has an impossible rank", err, err_len);
    }
    executorch::aten::SizesType dims[kMaxDims];
    executorch::aten::DimOrderType order[kMaxDims];
    executorch::aten::StridesType strides[kMaxDims];
    for (int d = 0; d < ndims[i]; ++d) {
      if (next[d] < 0 || next[d] > INT32_MAX) {
        return fail(Error::InvalidArgument, "input " + std::to_string(i) + " has an impossible size", err, err_len);
      }
      dims[d] = static_cast<executorch::aten::SizesType>(next[d]);
      order[d] = static_cast<executorch::aten::DimOrderType>(d);
    }
    executorch::aten::StridesType stride = 1;
    for (int d = ndims[i] - 1; d >= 0; --d) {
      strides[d] = stride;
      stride *= dims[d] > 0 ? dims[d] : 1;
    }
    next += ndims[i];
    TensorImpl impl(static_cast<ScalarType>(dtypes[i]), ndims[i], dims, data[i], order, strides);
    Error set = session->method->set_input(EValue(Tensor(&impl)), static_cast<size_t>(i));
    if (set != Error::Ok) {
      return fail(set, "input " + std::to_string(i) + " was refused", err, err_len);
    }
  }
  Error done = session->method->execute();
  if (done != Error::Ok) {
    return fail(done, "the method failed", err, err_len);
  }
  return 0;
}

// Output `index` of the last run: where its data is (valid until the next run), its dtype, rank and sizes.
int edgeline_et_output(void* handle, int index, const void** data, int* dtype, int* ndim, int64_t* sizes,
                       size_t* nbytes, char* err, size_t err_len) {
  auto* session = static_cast<Session*>(handle);
  if (!session->method || static_cast<size_t>(index) >= session->method->outputs_size()) {
    return fail(Error::InvalidArgument, "no output " + std::to_string(index), err, err_len);
  }
  const EValue& value = session->method->get_output(static_cast<size_t>(index));
  if (!value.isTensor()) {
    return fail(Error::NotSupported, "output " + std::to_string(index) + " is not a tensor", err, err_len);
  }
  const Tensor& tensor = value.toTensor();
  if (tensor.dim() > kMaxDims) {
    return fail(Error::NotSupported, "an output of more than 16 dimensions", err, err_len);
  }
  *data = tensor.const_data_ptr();
  *dtype = static_cast<int>(tensor.scalar_type());
  *ndim = static_cast<int>(tensor.dim());
  for (ssize_t d = 0; d < tensor.dim(); ++d) {
    sizes[d] = tensor.size(d);
  }
  *nbytes = tensor.nbytes();
  return 0;
}

}  // extern "C"
