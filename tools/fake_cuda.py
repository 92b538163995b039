"""A fake H100 (or another of GPUS) for PyTorch without a GPU (a CPU build, or a CUDA build on a machine
without one): what lets tools/preflight.py run the trainer's CUDA code path on fake tensors.

`load()` builds tools/fake_cuda.cpp with g++ against the installed PyTorch's headers (once per
PyTorch install and source version, into .cache/fake_cuda/) and loads it: a CUDA device guard and
CUDA hooks, which is all FakeTensorMode needs to hold tensors on device "cuda". It must run before
`import torch`, because PyTorch reads its CUDA hooks once. `pretend_gpu()` then makes torch.cuda
answer like one H100 SXM (compute capability 9.0, 132 SMs, 227 KiB of shared memory per block), or
another card of GPUS, in torch.cuda and in the device interface torch.compile asks. For inductor,
`fake_triton()` gives triton a driver that compiles every kernel for that card (sm_90 for the H100)
with triton's own ptxas and launches none.

Nothing here allocates device memory or runs a kernel: fake tensors have shapes, dtypes, strides
and devices but no data.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

SOURCE = Path(__file__).resolve().with_name("fake_cuda.cpp")
CACHE_DIR = SOURCE.parent.parent / ".cache" / "fake_cuda"

# torch.cuda.get_device_properties of an H100 80GB HBM3 (SXM), the record's GPU; the memory is what
# nvidia-smi reports there (81,559 MiB).
H100 = SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=81_559 * 2 ** 20, multi_processor_count=132,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32, regs_per_multiprocessor=65536,
    shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=227 * 1024,
    shared_memory_per_multiprocessor=228 * 1024, L2_cache_size=50 * 2 ** 20, clock_rate=1_980_000,
    memory_clock_rate=2_619_000, memory_bus_width=5120, is_integrated=False, is_multi_gpu_board=False,
    gcnArchName="NVIDIA H100 80GB HBM3", uuid="fake-h100", pci_bus_id=0, pci_device_id=0, pci_domain_id=0,
    short_name="H100")


def profile(name: str, short_name: str, capability: tuple[int, int], memory_mib: int, sms: int, shared_kib: int,
            l2_mib: int, threads_per_sm: int, memory_bus_width: int) -> SimpleNamespace:
    """Another GPU as torch.cuda would describe it: the H100's fields with this card's own values. Memory is
    what nvidia-smi shows for such a card (published figures, not measured here); `shared_kib` is the most
    shared memory one block may opt into, which bounds every Triton kernel."""
    return SimpleNamespace(**{**vars(H100), **dict(
        name=name, gcnArchName=name, short_name=short_name, uuid=f"fake-{short_name.lower().replace(' ', '-')}",
        major=capability[0], minor=capability[1], total_memory=memory_mib * 2 ** 20, multi_processor_count=sms,
        shared_memory_per_block_optin=shared_kib * 1024, shared_memory_per_multiprocessor=(shared_kib + 1) * 1024,
        L2_cache_size=l2_mib * 2 ** 20, max_threads_per_multi_processor=threads_per_sm,
        memory_bus_width=memory_bus_width)})


# The cards `tools/preflight.py --gpu=NAME` can stand in for. FP8 matmuls need compute capability 8.9 (Ada)
# or later, so the A100s and the RTX 3090 train in bf16 where the H100 uses FP8.
GPUS = {
    "h100": H100,
    "h200": profile("NVIDIA H200", "H200", (9, 0), 143_771, 132, 227, 50, 2048, 6144),
    "a100-80gb": profile("NVIDIA A100-SXM4-80GB", "A100 80GB", (8, 0), 81_920, 108, 163, 40, 2048, 5120),
    "a100-40gb": profile("NVIDIA A100-SXM4-40GB", "A100 40GB", (8, 0), 40_960, 108, 163, 40, 2048, 5120),
    "l40s": profile("NVIDIA L40S", "L40S", (8, 9), 46_068, 142, 99, 96, 1536, 384),
    "l4": profile("NVIDIA L4", "L4", (8, 9), 23_034, 58, 99, 48, 1536, 192),
    "rtx4090": profile("NVIDIA GeForce RTX 4090", "RTX 4090", (8, 9), 24_564, 128, 99, 72, 1536, 384),
    "rtx3090": profile("NVIDIA GeForce RTX 3090", "RTX 3090", (8, 6), 24_576, 82, 99, 6, 1536, 384),
}
gpu = H100  # the card pretend_gpu() last made torch.cuda describe


def has_fp8(card: SimpleNamespace) -> bool:
    return (card.major, card.minor) >= (8, 9)


class ShimError(RuntimeError):
    """The fake CUDA device cannot be built or loaded; the message says why in one line."""


loaded: Path | None = None  # the shared library load() put into this process


def torch_dir() -> Path:
    """The installed torch package, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        raise ShimError("PyTorch is not installed in this Python")
    return Path(spec.origin).parent


def library_name(source: bytes, torch_version: str, torch_path: Path) -> str:
    """One library per source, PyTorch version and install: any change builds a new one."""
    key = hashlib.sha256(source + f"\0{torch_version}\0{torch_path}".encode()).hexdigest()[:16]
    return f"fake_cuda-{key}.so"


def build(cache_dir: Path = CACHE_DIR, compiler: str = "g++", torch_path: Path | None = None) -> Path:
    """The shim for this PyTorch install, compiled unless the cache holds it already."""
    torch_path = torch_path or torch_dir()
    headers = torch_path / "include"
    if not (headers / "ATen" / "detail" / "CUDAHooksInterface.h").is_file():
        raise ShimError(f"{headers}: PyTorch's C++ headers are missing; the fake CUDA device is built against them "
                        f"(a PyTorch wheel from pip ships them)")
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    library = Path(cache_dir) / library_name(SOURCE.read_bytes(), version, torch_path.resolve())
    if library.is_file():
        return library
    if shutil.which(compiler) is None:
        raise ShimError(f"{compiler} not found: the fake CUDA device ({SOURCE.name}) is built with it; install a C++ "
                        f"compiler (Debian/Ubuntu: apt-get install g++)")
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ShimError(f"{library.parent}: cannot create the build folder of the fake CUDA device ({e.strerror})") from None
    partial = library.with_name(f".{library.name}.{os.getpid()}")  # renamed when complete: no half-built library
    lib_dir = torch_path / "lib"
    command = [compiler, "-shared", "-fPIC", "-O1", "-std=c++20", "-w", f"-I{headers}", str(SOURCE),
               f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}", "-o", str(partial)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        errors = [line for line in proc.stderr.splitlines() if "error" in line] or proc.stderr.splitlines() or ["?"]
        raise ShimError(f"{SOURCE.name}: {compiler} failed against PyTorch {version}: {errors[0].strip()}")
    os.replace(partial, library)
    return library


def load(cache_dir: Path = CACHE_DIR) -> Path:
    """Builds (if needed) and loads the shim into this process; before torch is imported."""
    global loaded
    if loaded is not None:
        return loaded
    if "torch" in sys.modules:
        raise ShimError("the fake CUDA device must be loaded before torch is imported (PyTorch reads its CUDA "
                        "hooks once)")
    library = build(cache_dir)
    try:
        shim = ctypes.CDLL(str(library))
    except OSError as e:
        raise ShimError(f"{library}: cannot load the fake CUDA device ({e})") from None
    # A CUDA build of PyTorch registers its own hooks and device guard as torch loads them: its hooks
    # are skipped (the shim's have priority; the registry says so on stderr, the one line dropped here)
    # and its guard is replaced again once torch is in.
    with stderr_without("Higher priority item already registered, skipping registration of CUDAHooks"):
        import torch  # noqa: F401
    shim.fake_cuda_register_guard()
    loaded = library
    return library


@contextlib.contextmanager
def stderr_without(line: str):
    """What C++ code writes to the process's stderr (file descriptor 2) meanwhile, less that one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [text for text in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if text.rstrip("\n") != line]
            sys.stderr.write("".join(kept))


def pretend_gpu(card: SimpleNamespace = H100):
    """torch.cuda and torch.compile's device interface answer like one such card (an H100 unless another of
    GPUS is given): its name, compute capability, memory and limits. No memory, no kernels."""
    global gpu
    if loaded is None:
        raise ShimError("load() the fake CUDA device before pretend_gpu()")
    gpu = card
    import torch
    from torch._dynamo import device_interface
    from torch._subclasses import fake_tensor

    cuda = torch.cuda
    cuda._initialized = True  # torch.cuda's lazy initialisation would look for a driver
    # FakeTensorMode makes one real CUDA tensor first, to set up a CUDA build's context for backward;
    # the fake device needs none.
    fake_tensor.init_gpu_context = lambda device: None
    answers = dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0, set_device=lambda device: None,
        get_device_capability=lambda device=None: (card.major, card.minor),
        get_device_properties=lambda device=None: card, get_device_name=lambda device=None: card.name,
        is_bf16_supported=lambda including_emulation=True: True, synchronize=lambda device=None: None,
        memory_allocated=lambda device=None: 0, _exchange_device=lambda device: 0,
        _maybe_exchange_device=lambda device: 0,
        # the CUDA generator's state (seed and offset): torch.compile and checkpoints save it
        get_rng_state=lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        set_rng_state=lambda new_state, device="cuda": None,
    )
    for name, answer in answers.items():
        setattr(cuda, name, answer)
    interface = device_interface.CudaInterface
    for name in ("current_device", "set_device", "device_count", "get_device_properties", "synchronize",
                 "memory_allocated", "is_bf16_supported", "_exchange_device", "_maybe_exchange_device"):
        setattr(interface, name.removeprefix("_"), staticmethod(answers[name]))
    device_interface.caching_worker_device_properties["cuda"] = [card]


def set_in_every_thread(config, name: str, value):
    """A torch config setting (torch._inductor.config and the like) for this process: assigned, and made the
    default that threads without an assignment of their own read (PyTorch 2.13 keeps assignments per thread;
    earlier versions have one value, which the assignment sets)."""
    setattr(config, name, value)
    entry = getattr(config, "_config", {}).get(name)
    if entry is not None:
        entry.default = value


def fake_triton() -> list[tuple[str, int]]:
    """Lets torch.compile's inductor generate and compile every Triton kernel for the card pretend_gpu()
    set (sm_90 for the H100), with triton's own bundled ptxas, and launch none. Returns the list that
    collects each kernel loaded: (name, bytes of shared memory). Needs `triton` (pip install triton)."""
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes import fuse_attention
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import GPUDriver
    from triton.backends.nvidia.driver import CudaDriver, ty_to_cpp
    from triton.runtime import driver as active_driver

    loaded_kernels: list[tuple[str, int]] = []

    class DeviceUtils:
        """What triton asks the CUDA driver: the card's limits; loading a kernel records it, nothing more.
        Triton itself refuses a kernel that needs more shared memory than max_shared_mem."""

        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": gpu.shared_memory_per_block_optin, "multiprocessor_count": gpu.multi_processor_count,
                    "max_num_regs": gpu.regs_per_multiprocessor, "warpSize": gpu.warp_size,
                    "sm_clock_rate": gpu.clock_rate, "mem_clock_rate": gpu.memory_clock_rate,
                    "mem_bus_width": gpu.memory_bus_width}

        @staticmethod
        def load_binary(name, kernel, shared, device):
            loaded_kernels.append((name, shared))
            return 0, 0, 0, 0, gpu.max_threads_per_block  # module, function, registers, spills, max threads

        @staticmethod
        def unload_module(module):
            pass

    class NoLaunch:
        def __init__(self, src, metadata):
            pass

        def __call__(self, *args, **kwargs):
            pass

    class FakeDriver(CudaDriver):  # a CudaDriver, so that inductor keeps it as the active one
        def __init__(self):
            GPUDriver.__init__(self)  # torch's device queries; CudaDriver's own would load libcuda
            self.utils, self.launcher_cls = DeviceUtils(), NoLaunch
            self.get_current_stream = lambda device=None: 0

        def get_current_target(self):
            return GPUTarget("cuda", 10 * gpu.major + gpu.minor, gpu.warp_size)

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty_to_cpp(ty)

    active_driver.set_active(FakeDriver())
    # Inductor steps that run ops or time kernels on the device itself.
    CachingAutotuner.benchmark_all_configs = lambda self, *args, **kwargs: {launcher: 0.0 for launcher in self.launchers}
    # Set in every thread: from PyTorch 2.13 a config assignment holds only in the thread that makes it, and the
    # backward's graphs (and what a gradient hook compiles) are compiled on autograd's threads.
    for name, value in (("joint_graph_constant_folding", False), ("shape_padding", False),
                        ("use_static_cuda_launcher", False),  # a CUDA build's C++ launcher
                        ("compile_threads", 1),  # compile workers would be processes without the fake device
                        # every kernel compiled afresh for this card: a graph cached by an earlier compile (on disk,
                        # or loaded in this process by an earlier preflight run) would load none, and count none
                        ("force_disable_caches", True)):
        set_in_every_thread(inductor_config, name, value)
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # its notice of the above
    from torch._inductor.codecache import PyCodeCache
    PyCodeCache.cache_clear()
    fuse_attention._sfdp_init = lambda input_device=None: None  # SDPA patterns built from real CUDA tensors
    # The generated code's allocation and stream helpers, C++ fast paths that bypass fake tensors.
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    torch._C._dynamo.guards._empty_strided_cuda = (
        lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device="cuda"))
    torch._C._dynamo.guards._reinterpret_tensor = (
        lambda t, size, stride, offset=0: t.as_strided(size, stride, t.storage_offset() + offset))
    # Inductor calls the out= form of _scaled_mm, which has no meta kernel (the functional form has one).
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm.out", "Meta"):
        def scaled_mm_out(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False,
                          *, out):
            result = torch.ops.aten._scaled_mm.default(a, b, scale_a, scale_b, bias, scale_result, out_dtype,
                                                       use_fast_accum)
            return out.resize_(result.shape)

        meta_kernels = torch.library.Library("aten", "IMPL")
        meta_kernels.impl("_scaled_mm.out", scaled_mm_out, "Meta")
        _keep_alive.append(meta_kernels)
    # Inductor's generated code checks the alignment of its inputs' data pointers; fake tensors have none.
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")  # triton 3.9's notice
    return loaded_kernels


_keep_alive: list = []  # a torch.library registration lasts as long as its Library object
