// A fake CUDA device for PyTorch without a GPU (a CPU build, or a CUDA build on a machine without
// one), so that FakeTensorMode can hold tensors on device "cuda" and run the trainer's CUDA code path
// (tools/preflight.py).
//
// Two registrations are all it takes. c10's own FakeGuardImpl answers as the CUDA device guard:
// without it, indexing a CUDA tensor fails ("PyTorch is not linked with support for cuda
// devices"). CUDA hooks that say a device is present: without them, autograd refuses to run
// backward on CUDA tensors ("Cannot access accelerator device when none is available"). Nothing
// here allocates device memory or runs a kernel; fake tensors never ask for either.
//
// PyTorch reads its CUDA hooks once, when it first needs them: load this library before
// `import torch` (tools/fake_cuda.py does, with ctypes).

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
namespace {

struct FakeCUDAHooks final : CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs /*unused*/) {}

  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex /*device*/) const override {}
  DeviceIndex exchangeDevice(DeviceIndex /*device*/) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex /*device*/) const override { return 0; }
};

}  // namespace

// Registry.h's registries live in namespace at; the key is the one at::detail::getCUDAHooks asks for.
// Preferred over the default priority at which a CUDA build's own hooks register when torch loads
// them (after this library), so those are skipped.
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED, FakeCUDAHooks)

}  // namespace at

namespace {
const c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_guard;
const c10::impl::DeviceGuardImplRegistrar fake_guard_registrar(c10::DeviceType::CUDA, &fake_guard);
}  // namespace

// A CUDA build registers its own device guard when torch loads it, replacing the one above:
// tools/fake_cuda.py calls this once torch is imported.
extern "C" void fake_cuda_register_guard() {
  c10::impl::DeviceGuardImplRegistrar(c10::DeviceType::CUDA, &fake_guard);
}
