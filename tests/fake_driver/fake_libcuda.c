// A recording stand-in for the NVIDIA driver (libcuda.so.1), for testing the host side of the CUDA
// path on machines without a GPU. It implements the entry points cuda-bindings, cuda-core and paged
// call, behaves like the driver where that catches host-side bugs (kernels resolve only by their
// mangled name in the cubin's symbol table; parameters are read with the sizes the cubin declares;
// shared memory beyond 48 KB needs the opt-in attribute; a launch needs a current context matching
// its stream), backs "device memory" with host memory (so a copy in any direction is a memcpy) and runs no
// kernel. Every call that matters
// is appended to $FAKE_CUDA_LOG as one JSON object per line.
//
// Settings (environment): FAKE_CUDA_DEVICES (1), FAKE_CUDA_DRIVER_VERSION (13000),
// FAKE_CUDA_CC (90: compute capability 9.0), FAKE_CUDA_SMEM_OPTIN (232448, an H100).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;

enum {
  SUCCESS = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  INVALID_DEVICE = 101,
  INVALID_IMAGE = 200,
  INVALID_CONTEXT = 201,
  NO_BINARY_FOR_GPU = 209,
  INVALID_HANDLE = 400,
  NOT_FOUND = 500,
  NOT_SUPPORTED = 801,
};

#define MAX_DEVICES 8
#define MAX_KERNELS 16
#define MAX_PARAMS 32
#define DEFAULT_SMEM 49152
#define RESERVED_SMEM 1024
#define EM_CUDA 190
#define STO_CUDA_ENTRY 0x10

// ---------------------------------------------------------------------------------------- settings

static int g_initialized;
static int g_num_devices = 1;
static int g_driver_version = 13000;
static int g_cc = 90;
static int g_smem_optin = 232448;
static FILE* g_log;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static int env_int(const char* name, int fallback) {
  const char* value = getenv(name);
  return value && *value ? atoi(value) : fallback;
}

static void record(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void record(const char* fmt, ...) {
  if (!g_log) return;
  va_list args;
  va_start(args, fmt);
  pthread_mutex_lock(&g_lock);
  vfprintf(g_log, fmt, args);
  fputc('\n', g_log);
  fflush(g_log);
  pthread_mutex_unlock(&g_lock);
  va_end(args);
}

__attribute__((constructor)) static void setup(void) {
  g_num_devices = env_int("FAKE_CUDA_DEVICES", 1);
  if (g_num_devices > MAX_DEVICES) g_num_devices = MAX_DEVICES;
  g_driver_version = env_int("FAKE_CUDA_DRIVER_VERSION", 13000);
  g_cc = env_int("FAKE_CUDA_CC", 90);
  g_smem_optin = env_int("FAKE_CUDA_SMEM_OPTIN", 232448);
  const char* path = getenv("FAKE_CUDA_LOG");
  if (path && *path) g_log = fopen(path, "a");
}

// ------------------------------------------------------------------------------- contexts, streams

typedef struct {
  int device;
  int retained;
} Context;

typedef struct {
  uint32_t magic;
  Context* ctx;
  unsigned long long id;
  unsigned flags;
  int priority;
} Stream;

#define STREAM_MAGIC 0x57AE4u

static Context g_primary[MAX_DEVICES];
static unsigned long long g_next_stream_id = 1;
// The driver keeps a context stack per thread; its top is the current context.
static __thread Context* t_stack[16];
static __thread int t_depth;

static Context* current(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }

static int valid_context(const Context* ctx) {
  return ctx >= g_primary && ctx < g_primary + g_num_devices;
}

// Legacy (0x1), per-thread (0x2) and null stream handles mean the current context's default stream.
static Stream* real_stream(void* handle) {
  if ((uintptr_t)handle <= 2) return NULL;
  Stream* stream = handle;
  return stream->magic == STREAM_MAGIC ? stream : NULL;
}

static int special_stream(void* handle) { return (uintptr_t)handle <= 2; }

// ------------------------------------------------------------------------------------------ cubins

typedef struct {
  char name[512];
  int num_params;
  uint32_t param_offset[MAX_PARAMS];
  uint32_t param_size[MAX_PARAMS];
  int static_smem;
  int max_dynamic_smem;
  int num_regs;
} Kernel;

typedef struct {
  int sm;
  int num_kernels;
  Kernel kernels[MAX_KERNELS];
} Library;

// `.nv.info.<kernel>` is a list of attributes: format u8, attribute u8, then a u16 value (formats
// 1-3: none, byte, half) or a u16 length and that many bytes (format 4). EIATTR_KPARAM_INFO holds
// index u32, ordinal u16, offset u16, then a u32 whose bits 18..31 are the parameter's size.
#define EIFMT_SVAL 4
#define EIATTR_KPARAM_INFO 0x17

static int parse_params(Kernel* k, const uint8_t* p, size_t size) {
  size_t at = 0;
  while (at + 2 <= size) {
    const uint8_t format = p[at], attr = p[at + 1];
    at += 2;
    size_t len = 2;
    if (format == EIFMT_SVAL) {
      if (at + 2 > size) return -1;
      len = (size_t)p[at] | ((size_t)p[at + 1] << 8);
      at += 2;
    } else if (format < 1 || format > 3) {
      return -1;
    }
    if (at + len > size) return -1;
    if (attr == EIATTR_KPARAM_INFO && len >= 12) {
      uint16_t ordinal, offset;
      uint32_t flags;
      memcpy(&ordinal, p + at + 4, 2);
      memcpy(&offset, p + at + 6, 2);
      memcpy(&flags, p + at + 8, 4);
      if (ordinal >= MAX_PARAMS) return -1;
      k->param_offset[ordinal] = offset;
      k->param_size[ordinal] = (flags >> 18) & 0x3fff;
      if (ordinal + 1 > k->num_params) k->num_params = ordinal + 1;
    }
    at += len;
  }
  return 0;
}

static CUresult parse_cubin(const uint8_t* image, Library* lib) {
  const Elf64_Ehdr* eh = (const Elf64_Ehdr*)image;
  if (memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 || eh->e_ident[EI_CLASS] != ELFCLASS64 || eh->e_machine != EM_CUDA)
    return INVALID_IMAGE;
  // ELF ABI version 8 (CUDA 13) keeps the SM in bits 8..15 of e_flags, older ones in bits 0..7.
  lib->sm = eh->e_ident[EI_ABIVERSION] >= 8 ? (eh->e_flags >> 8) & 0xff : eh->e_flags & 0xff;
  const Elf64_Shdr* sh = (const Elf64_Shdr*)(image + eh->e_shoff);
  const char* names = (const char*)image + sh[eh->e_shstrndx].sh_offset;
  const Elf64_Shdr *symtab = NULL, *strtab = NULL;
  for (int i = 0; i < eh->e_shnum; ++i) {
    if (sh[i].sh_type == SHT_SYMTAB) {
      symtab = &sh[i];
      strtab = &sh[sh[i].sh_link];
    }
  }
  if (!symtab) return INVALID_IMAGE;
  const Elf64_Sym* syms = (const Elf64_Sym*)(image + symtab->sh_offset);
  const char* sym_names = (const char*)image + strtab->sh_offset;
  for (size_t i = 0; i < symtab->sh_size / sizeof(Elf64_Sym); ++i) {
    // Kernels are the FUNC symbols marked as entry points (template instantiations bind weakly).
    if (ELF64_ST_TYPE(syms[i].st_info) != STT_FUNC || !(syms[i].st_other & STO_CUDA_ENTRY)) continue;
    if (lib->num_kernels == MAX_KERNELS) break;
    Kernel* k = &lib->kernels[lib->num_kernels++];
    memset(k, 0, sizeof(*k));
    snprintf(k->name, sizeof(k->name), "%s", sym_names + syms[i].st_name);
  }
  // On sm_80 and newer the driver keeps 1 KB of every block's shared memory for itself; such
  // cubins have a `.nv.shared.reserved.*` section and count that 1 KB into each kernel's
  // `.nv.shared.<kernel>`, which the static size the driver reports leaves out.
  int reserved = 0;
  for (int i = 0; i < eh->e_shnum; ++i) {
    if (strncmp(names + sh[i].sh_name, ".nv.shared.reserved.", 20) == 0) reserved = RESERVED_SMEM;
  }
  for (int i = 0; i < eh->e_shnum; ++i) {
    const char* section = names + sh[i].sh_name;
    for (int j = 0; j < lib->num_kernels; ++j) {
      Kernel* k = &lib->kernels[j];
      if (strncmp(section, ".nv.info.", 9) == 0 && strcmp(section + 9, k->name) == 0) {
        if (parse_params(k, image + sh[i].sh_offset, sh[i].sh_size) != 0) return INVALID_IMAGE;
      } else if (strncmp(section, ".nv.shared.", 11) == 0 && strcmp(section + 11, k->name) == 0) {
        k->static_smem = (int)sh[i].sh_size - reserved;
      }
    }
  }
  // Without the opt-in attribute, static and dynamic shared memory together get 48 KB.
  for (int j = 0; j < lib->num_kernels; ++j) lib->kernels[j].max_dynamic_smem = DEFAULT_SMEM - lib->kernels[j].static_smem;
  return SUCCESS;
}

static Kernel* find_kernel(void* handle) {
  // Kernels live inside their Library, which is never freed while the process runs.
  return (Kernel*)handle;
}

// ------------------------------------------------------------------------------------ entry points

CUresult cuInit(unsigned flags) {
  (void)flags;
  g_initialized = 1;
  record("{\"call\": \"cuInit\"}");
  return SUCCESS;
}

CUresult cuDriverGetVersion(int* version) {
  if (!version) return INVALID_VALUE;
  *version = g_driver_version;
  return SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** name) {
  static const struct {
    CUresult code;
    const char* name;
  } names[] = {{SUCCESS, "CUDA_SUCCESS"},
               {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
               {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
               {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
               {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
               {INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE"},
               {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
               {NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU"},
               {INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
               {NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
               {NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"}};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); ++i) {
    if (names[i].code == error) {
      *name = names[i].name;
      return SUCCESS;
    }
  }
  *name = "CUDA_ERROR_UNKNOWN";
  return SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** text) { return cuGetErrorName(error, text); }

#define REQUIRE_INIT() \
  if (!g_initialized) return NOT_INITIALIZED

CUresult cuDeviceGetCount(int* count) {
  REQUIRE_INIT();
  *count = g_num_devices;
  return SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  REQUIRE_INIT();
  if (ordinal < 0 || ordinal >= g_num_devices) return INVALID_DEVICE;
  *device = ordinal;
  return SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice device) {
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  snprintf(name, (size_t)len, "paged fake GPU %d (sm_%d)", device, g_cc);
  return SUCCESS;
}

CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice device) {
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  memset(uuid, 0, 16);
  uuid[0] = (unsigned char)(device + 1);
  return SUCCESS;
}

CUresult cuDeviceTotalMem(size_t* bytes, CUdevice device) {
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  *bytes = (size_t)80 << 30;
  return SUCCESS;
}

// CUdevice_attribute values from cuda.h that paged and cuda-core read; others read as 0.
static int attribute(int attr) {
  switch (attr) {
    case 1: return 1024;           // MAX_THREADS_PER_BLOCK
    case 2: case 3: return 1024;   // MAX_BLOCK_DIM_X, _Y
    case 4: return 64;             // MAX_BLOCK_DIM_Z
    case 5: return 2147483647;     // MAX_GRID_DIM_X
    case 6: case 7: return 65535;  // MAX_GRID_DIM_Y, _Z
    case 8: return DEFAULT_SMEM;   // MAX_SHARED_MEMORY_PER_BLOCK
    case 10: return 32;            // WARP_SIZE
    case 16: return 132;           // MULTIPROCESSOR_COUNT
    case 38: return 50 << 20;      // L2_CACHE_SIZE
    case 39: return 2048;          // MAX_THREADS_PER_MULTIPROCESSOR
    case 75: return g_cc / 10;     // COMPUTE_CAPABILITY_MAJOR
    case 76: return g_cc % 10;     // COMPUTE_CAPABILITY_MINOR
    case 81: return 233472;        // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR (228 KB, an H100)
    case 82: return 65536;         // MAX_REGISTERS_PER_MULTIPROCESSOR
    case 97: return g_smem_optin;  // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    case 111: return g_cc >= 80 ? RESERVED_SMEM : 0;  // RESERVED_SHARED_MEMORY_PER_BLOCK
    default: return 0;
  }
}

CUresult cuDeviceGetAttribute(int* value, int attr, CUdevice device) {
  REQUIRE_INIT();
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  *value = attribute(attr);
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(Context** ctx, CUdevice device) {
  REQUIRE_INIT();
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  g_primary[device].device = device;
  g_primary[device].retained++;
  *ctx = &g_primary[device];
  record("{\"call\": \"cuDevicePrimaryCtxRetain\", \"device\": %d}", device);
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice device) {
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  if (g_primary[device].retained) g_primary[device].retained--;
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned* flags, int* active) {
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  *flags = 0;
  *active = g_primary[device].retained > 0;
  return SUCCESS;
}

CUresult cuCtxGetCurrent(Context** ctx) {
  REQUIRE_INIT();
  *ctx = current();
  return SUCCESS;
}

CUresult cuCtxSetCurrent(Context* ctx) {
  REQUIRE_INIT();
  if (ctx && !valid_context(ctx)) return INVALID_CONTEXT;
  if (!ctx) {
    if (t_depth) t_depth--;
  } else if (t_depth) {
    t_stack[t_depth - 1] = ctx;
  } else {
    t_stack[t_depth++] = ctx;
  }
  record("{\"call\": \"cuCtxSetCurrent\", \"device\": %d}", ctx ? ctx->device : -1);
  return SUCCESS;
}

CUresult cuCtxPushCurrent(Context* ctx) {
  REQUIRE_INIT();
  if (!valid_context(ctx) || t_depth == 16) return INVALID_CONTEXT;
  t_stack[t_depth++] = ctx;
  record("{\"call\": \"cuCtxPushCurrent\", \"device\": %d}", ctx->device);
  return SUCCESS;
}

CUresult cuCtxPopCurrent(Context** ctx) {
  REQUIRE_INIT();
  if (!t_depth) return INVALID_CONTEXT;
  Context* top = t_stack[--t_depth];
  if (ctx) *ctx = top;
  record("{\"call\": \"cuCtxPopCurrent\", \"device\": %d}", top->device);
  return SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* device) {
  REQUIRE_INIT();
  Context* ctx = current();
  if (!ctx) return INVALID_CONTEXT;
  *device = ctx->device;
  return SUCCESS;
}

CUresult cuCtxSynchronize(void) { return current() ? SUCCESS : INVALID_CONTEXT; }

CUresult cuCtxGetApiVersion(Context* ctx, unsigned* version) {
  (void)ctx;
  *version = 3020;
  return SUCCESS;
}

CUresult cuCtxGetFlags(unsigned* flags) {
  *flags = 0;
  return current() ? SUCCESS : INVALID_CONTEXT;
}

CUresult cuCtxGetId(Context* ctx, unsigned long long* id) {
  if (!ctx) ctx = current();
  if (!valid_context(ctx)) return INVALID_CONTEXT;
  *id = (unsigned long long)(ctx - g_primary) + 1;
  return SUCCESS;
}

CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return SUCCESS;
}

CUresult cuStreamCreateWithPriority(Stream** out, unsigned flags, int priority) {
  Context* ctx = current();
  if (!ctx) return INVALID_CONTEXT;
  Stream* stream = calloc(1, sizeof(Stream));
  stream->magic = STREAM_MAGIC;
  stream->ctx = ctx;
  stream->flags = flags;
  stream->priority = priority;
  pthread_mutex_lock(&g_lock);
  stream->id = g_next_stream_id++;
  pthread_mutex_unlock(&g_lock);
  *out = stream;
  record("{\"call\": \"cuStreamCreate\", \"stream\": %llu, \"device\": %d}", stream->id, ctx->device);
  return SUCCESS;
}

CUresult cuStreamCreate(Stream** out, unsigned flags) { return cuStreamCreateWithPriority(out, flags, 0); }

CUresult cuStreamDestroy(Stream* stream) {
  if (!real_stream(stream)) return INVALID_HANDLE;
  stream->magic = 0;
  free(stream);
  return SUCCESS;
}

CUresult cuStreamSynchronize(void* handle) {
  return real_stream(handle) || special_stream(handle) ? SUCCESS : INVALID_HANDLE;
}

CUresult cuStreamQuery(void* handle) { return cuStreamSynchronize(handle); }

CUresult cuStreamGetCtx(void* handle, Context** ctx) {
  Stream* stream = real_stream(handle);
  if (!stream && !special_stream(handle)) return INVALID_HANDLE;
  *ctx = stream ? stream->ctx : current();
  return *ctx ? SUCCESS : INVALID_CONTEXT;
}

CUresult cuStreamGetDevice(void* handle, CUdevice* device) {
  Context* ctx;
  CUresult status = cuStreamGetCtx(handle, &ctx);
  if (status == SUCCESS) *device = ctx->device;
  return status;
}

CUresult cuStreamGetFlags(void* handle, unsigned* flags) {
  Stream* stream = real_stream(handle);
  if (!stream && !special_stream(handle)) return INVALID_HANDLE;
  *flags = stream ? stream->flags : 0;
  return SUCCESS;
}

CUresult cuStreamGetPriority(void* handle, int* priority) {
  Stream* stream = real_stream(handle);
  if (!stream && !special_stream(handle)) return INVALID_HANDLE;
  *priority = stream ? stream->priority : 0;
  return SUCCESS;
}

CUresult cuStreamGetId(void* handle, unsigned long long* id) {
  Stream* stream = real_stream(handle);
  if (!stream && !special_stream(handle)) return INVALID_HANDLE;
  *id = stream ? stream->id : 0;
  return SUCCESS;
}

CUresult cuMemAlloc(CUdeviceptr* ptr, size_t bytes) {
  if (!current()) return INVALID_CONTEXT;
  void* memory = aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (!memory) return OUT_OF_MEMORY;
  *ptr = (CUdeviceptr)(uintptr_t)memory;
  return SUCCESS;
}

CUresult cuMemFree(CUdeviceptr ptr) {
  free((void*)(uintptr_t)ptr);
  return SUCCESS;
}

CUresult cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t bytes) {
  memcpy((void*)(uintptr_t)dst, src, bytes);
  return SUCCESS;
}

CUresult cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t bytes) {
  memcpy(dst, (const void*)(uintptr_t)src, bytes);
  return SUCCESS;
}

CUresult cuLibraryLoadData(Library** out, const void* code, void* jit_options, void** jit_values,
                           unsigned num_jit, void* lib_options, void** lib_values, unsigned num_lib) {
  (void)jit_options, (void)jit_values, (void)num_jit, (void)lib_options, (void)lib_values, (void)num_lib;
  REQUIRE_INIT();
  Library* lib = calloc(1, sizeof(Library));
  CUresult status = parse_cubin(code, lib);
  if (status == SUCCESS && lib->sm != g_cc) status = NO_BINARY_FOR_GPU;
  record("{\"call\": \"cuLibraryLoadData\", \"sm\": %d, \"kernels\": %d, \"status\": %d}", lib->sm, lib->num_kernels,
         status);
  if (status != SUCCESS) {
    free(lib);
    return status;
  }
  *out = lib;
  return SUCCESS;
}

CUresult cuLibraryUnload(Library* lib) {
  // Kernel handles point into the library; keep it so that a stale handle stays readable.
  (void)lib;
  return SUCCESS;
}

CUresult cuLibraryGetKernel(Kernel** out, Library* lib, const char* name) {
  if (!lib || !name) return INVALID_VALUE;
  for (int i = 0; i < lib->num_kernels; ++i) {
    if (strcmp(lib->kernels[i].name, name) == 0) {
      *out = &lib->kernels[i];
      record("{\"call\": \"cuLibraryGetKernel\", \"name\": \"%s\", \"found\": true}", name);
      return SUCCESS;
    }
  }
  record("{\"call\": \"cuLibraryGetKernel\", \"name\": \"%s\", \"found\": false}", name);
  return NOT_FOUND;
}

CUresult cuKernelGetFunction(void** func, void* kernel) {
  *func = kernel;
  return SUCCESS;
}

CUresult cuKernelGetName(const char** name, void* kernel) {
  *name = find_kernel(kernel)->name;
  return SUCCESS;
}

CUresult cuKernelGetParamInfo(void* kernel, size_t index, size_t* offset, size_t* size) {
  const Kernel* k = find_kernel(kernel);
  if ((int)index >= k->num_params) return INVALID_VALUE;
  if (offset) *offset = k->param_offset[index];
  if (size) *size = k->param_size[index];
  return SUCCESS;
}

CUresult cuKernelGetParamCount(void* kernel, size_t* count) {
  *count = (size_t)find_kernel(kernel)->num_params;
  return SUCCESS;
}

// CUfunction_attribute values from cuda.h.
enum { ATTR_MAX_THREADS = 0, ATTR_SHARED_SIZE = 1, ATTR_NUM_REGS = 4, ATTR_MAX_DYNAMIC_SHARED = 8 };

CUresult cuKernelGetAttribute(int* value, int attr, void* kernel, CUdevice device) {
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  const Kernel* k = find_kernel(kernel);
  switch (attr) {
    case ATTR_MAX_THREADS: *value = 1024; break;
    case ATTR_SHARED_SIZE: *value = k->static_smem; break;
    case ATTR_NUM_REGS: *value = k->num_regs; break;
    case ATTR_MAX_DYNAMIC_SHARED: *value = k->max_dynamic_smem; break;
    default: *value = 0;
  }
  return SUCCESS;
}

CUresult cuKernelSetAttribute(int attr, int value, void* kernel, CUdevice device) {
  if (device < 0 || device >= g_num_devices) return INVALID_DEVICE;
  Kernel* k = find_kernel(kernel);
  CUresult status = SUCCESS;
  if (attr != ATTR_MAX_DYNAMIC_SHARED) status = NOT_SUPPORTED;
  // Static and dynamic shared memory share the block's opt-in maximum.
  else if (value < 0 || value + k->static_smem > g_smem_optin) status = INVALID_VALUE;
  else k->max_dynamic_smem = value;
  record("{\"call\": \"cuKernelSetAttribute\", \"name\": \"%s\", \"attr\": %d, \"value\": %d, \"device\": %d, "
         "\"status\": %d}", k->name, attr, value, device, status);
  return status;
}

typedef struct {
  unsigned grid[3];
  unsigned block[3];
  unsigned shared_mem;
  void* stream;
  void* attrs;
  unsigned num_attrs;
} LaunchConfig;

static CUresult launch(const char* via, void* func, const unsigned grid[3], const unsigned block[3],
                       unsigned smem, void* handle, void** params, void** extra) {
  const Kernel* k = find_kernel(func);
  Context* ctx = current();
  Stream* stream = real_stream(handle);
  CUresult status = SUCCESS;
  if (!ctx) status = INVALID_CONTEXT;
  else if (!stream && !special_stream(handle)) status = INVALID_HANDLE;
  else if (stream && stream->ctx != ctx) status = INVALID_CONTEXT;
  else if (extra || !params) status = INVALID_VALUE;
  else if ((unsigned long long)block[0] * block[1] * block[2] > 1024 || !block[0] || !block[1] || !block[2])
    status = INVALID_VALUE;
  else if (!grid[0] || !grid[1] || !grid[2] || grid[1] > 65535 || grid[2] > 65535) status = INVALID_VALUE;
  else if ((int)smem > k->max_dynamic_smem || (int)smem + k->static_smem > g_smem_optin) status = INVALID_VALUE;
  // Without a log nothing is formatted: experiments/host_overhead.py times the caller's host cost per
  // launch on this fake, which string formatting would swamp.
  if (!g_log) return status;
  // One hex string per parameter, read with the size the cubin declares, as the driver copies them.
  char args[MAX_PARAMS * 24 + 8] = "";
  size_t used = 0;
  for (int i = 0; status == SUCCESS && i < k->num_params; ++i) {
    used += (size_t)snprintf(args + used, sizeof(args) - used, i ? ", \"" : "\"");
    const uint8_t* bytes = params[i];
    for (uint32_t b = 0; b < k->param_size[i] && used + 4 < sizeof(args); ++b)
      used += (size_t)snprintf(args + used, sizeof(args) - used, "%02x", bytes[b]);
    used += (size_t)snprintf(args + used, sizeof(args) - used, "\"");
  }
  record("{\"call\": \"%s\", \"name\": \"%s\", \"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], \"smem\": %u, "
         "\"stream\": %llu, \"special_stream\": %d, \"device\": %d, \"args\": [%s], \"status\": %d}",
         via, k->name, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
         stream ? stream->id : 0, special_stream(handle) ? (int)(uintptr_t)handle : -1, ctx ? ctx->device : -1, args,
         status);
  return status;
}

// Device memory is host memory here, so every direction of copy is a memcpy; like the driver, it
// needs a current context matching the stream's.
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void* handle) {
  Context* ctx = current();
  Stream* stream = real_stream(handle);
  CUresult status = SUCCESS;
  if (!ctx) status = INVALID_CONTEXT;
  else if (!stream && !special_stream(handle)) status = INVALID_HANDLE;
  else if (stream && stream->ctx != ctx) status = INVALID_CONTEXT;
  else if (!dst || !src) status = INVALID_VALUE;
  if (status == SUCCESS) memcpy((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, bytes);
  record("{\"call\": \"cuMemcpyAsync\", \"dst\": %llu, \"src\": %llu, \"bytes\": %zu, \"stream\": %llu, "
         "\"special_stream\": %d, \"device\": %d, \"status\": %d}",
         (unsigned long long)dst, (unsigned long long)src, bytes, stream ? stream->id : 0,
         special_stream(handle) ? (int)(uintptr_t)handle : -1, ctx ? ctx->device : -1, status);
  return status;
}

CUresult cuLaunchKernelEx(const LaunchConfig* config, void* func, void** params, void** extra) {
  return launch("cuLaunchKernelEx", func, config->grid, config->block, config->shared_mem, config->stream, params,
                extra);
}

CUresult cuLaunchKernel(void* func, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void* stream, void** params, void** extra) {
  const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
  return launch("cuLaunchKernel", func, grid, block, smem, stream, params, extra);
}

// ------------------------------------------------------------------------------ symbol resolution

// cuda-bindings resolves every entry point through cuGetProcAddress by its base name; this library
// exports each under that name, so the lookup is dlsym on itself. Unknown names report "not
// found", which the bindings surface only if that function is called.
CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, uint64_t flags, int* status) {
  (void)version, (void)flags;
  static void* self;
  if (!self) {
    Dl_info info;
    dladdr((void*)&cuGetProcAddress_v2, &info);
    self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }
  *pfn = dlsym(self, symbol);
  if (status) *status = *pfn ? 0 : 1;
  return *pfn ? SUCCESS : NOT_FOUND;
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, uint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

// NVRTC looks for the driver's private export tables when a libcuda.so.1 is loadable; having none
// is what it sees on a machine without a driver, and it then compiles without them.
CUresult cuGetExportTable(const void** table, const void* id) {
  (void)id;
  *table = NULL;
  return NOT_FOUND;
}
