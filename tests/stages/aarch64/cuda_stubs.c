/* Stand-ins for the two CUDA libraries the aarch64 torch wheel's libtorch_cpu names (libcudart, libcupti: the wheel
   is built with CUDA) and never calls in a CPU-only process: every call fails as "no device". Compiled once per
   library name (tests/stages/test_aarch64.py), each exporting its symbols under that library's version node. */
static const char *no_device = "no CUDA device (a stand-in for aarch64 emulation)";

#define NO_DEVICE(name) \
  int name(void) { return 100; /* cudaErrorNoDevice; any non-zero CUptiResult is an error too */ }
NO_DEVICE(cudaDeviceSynchronize) NO_DEVICE(cudaDriverGetVersion) NO_DEVICE(cudaGetDeviceCount)
NO_DEVICE(cudaGetDeviceProperties) NO_DEVICE(cudaRuntimeGetVersion)
NO_DEVICE(cuptiActivityDisable) NO_DEVICE(cuptiActivityEnable) NO_DEVICE(cuptiActivityEnableCudaEventDeviceTimestamps)
NO_DEVICE(cuptiActivityEnableDriverApi) NO_DEVICE(cuptiActivityEnableRuntimeApi) NO_DEVICE(cuptiActivityFlushAll)
NO_DEVICE(cuptiActivityGetNextRecord) NO_DEVICE(cuptiActivityGetNumDroppedRecords)
NO_DEVICE(cuptiActivityPopExternalCorrelationId) NO_DEVICE(cuptiActivityPushExternalCorrelationId)
NO_DEVICE(cuptiActivityRegisterCallbacks) NO_DEVICE(cuptiActivityRegisterTimestampCallback)
NO_DEVICE(cuptiActivitySetAttribute) NO_DEVICE(cuptiEnableCallback) NO_DEVICE(cuptiEnableDomain) NO_DEVICE(cuptiFinalize)
NO_DEVICE(cuptiGetCallbackName) NO_DEVICE(cuptiGetVersion) NO_DEVICE(cuptiSubscribe) NO_DEVICE(cuptiUnsubscribe)

const char *cudaGetErrorString(int error) { (void)error; return no_device; }
int cuptiGetResultString(int result, const char **text) { (void)result; *text = no_device; return 0; }
