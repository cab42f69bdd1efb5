"""Lab 13 - the GPUs a step is fitted to: memory as the vendor states it, and what a process can use.

A datasheet's "80 GB" is a marketing round number. The driver reports a total (NVML, what
``nvidia-smi`` shows); a PyTorch process gets less than that total: the driver keeps some, the CUDA
context and the kernels it loads take some, and the caching allocator cannot hand out every byte it
reserves (fragmentation). So the bytes a step may peak at, here ``capacity_bytes``, are

    (NVML total - CUDA_CONTEXT_BYTES) x (1 - ALLOCATOR_HEADROOM)

Both deductions are **assumptions until measured**: the GPU issue measures them on a lent card
(``torch.cuda.mem_get_info`` on an idle card before and after the context exists, and reserved
against allocated over a training loop). They live here, once, for the calculator's formulas. A
trace needs neither: Lab 13's verdict holds the step's reserved bytes, simulated by Lab 16's model of
the caching allocator, plus Lab 16's cited CUDA context, against ``total_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20

# --8<-- [start:capacity]
#: The driver's reservation plus a PyTorch process's CUDA context (with CUDA's lazy module loading,
#: PyTorch's default since CUDA 11.7, kernels load as first used). ASSUMED: PyTorch issue 34323
#: measured 781 MB for a context before lazy loading; 1 GiB also covers cuBLAS's workspaces.
CUDA_CONTEXT_BYTES = 1024 * MiB
CUDA_CONTEXT_SOURCE = ("our assumption, 1 GiB, until a lent card measures it: https://github.com/pytorch/pytorch/"
                       "issues/34323 measured a 781 MB context before lazy module loading "
                       "(https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#lazy-loading); the rest is "
                       "for cuBLAS's workspaces (https://docs.pytorch.org/docs/2.13/notes/cuda.html#cublas-workspaces)")

#: What the caching allocator holds beyond what is allocated (fragmentation, rounding of large blocks
#: into segments). ASSUMED: 5 % of what is left; Lab 12 shows how it grows in a bad pattern.
ALLOCATOR_HEADROOM = 0.05
HEADROOM_SOURCE = ("our assumption, 5 %, until a lent card measures reserved against allocated: the caching "
                   "allocator keeps freed blocks and splits segments, so it reserves more than tensors hold "
                   "(https://docs.pytorch.org/docs/2.13/notes/cuda.html#memory-management); Lab 12 shows it grow")

#: The driver's totals (nvidia-smi / NVML) are not in the vendors' datasheets: ASSUMED from what idle
#: cards report publicly, until the GPU issue reads ``torch.cuda.mem_get_info`` on each card it gets.
NVML_TABLE = ("our assumption: the total nvidia-smi reports on an idle card (NVML's total, "
              "https://docs.nvidia.com/deploy/nvml-api/structnvmlMemory__t.html); datasheets state only a round "
              "figure, so a lent card's torch.cuda.mem_get_info replaces it")


@dataclass(frozen=True)
class Gpu:
    """One card: its memory as the datasheet states it, and the total the driver reports."""

    name: str
    stated: str  # the datasheet's words
    datasheet: str  # the vendor's page
    total_mib: int  # NVML's total (nvidia-smi), MiB
    total_source: str

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MiB

    @property
    def capacity_bytes(self) -> int:
        """What one process's tensors may peak at: the total less the context, less the headroom."""
        return int((self.total_bytes - CUDA_CONTEXT_BYTES) * (1 - ALLOCATOR_HEADROOM))
# --8<-- [end:capacity]


_NV = "https://www.nvidia.com/en-us/data-center/"
GPUS = {g.name: g for g in (
    Gpu("h100-80gb", "80 GB HBM3 (H100 SXM)", _NV + "h100/", 81_559, NVML_TABLE),
    Gpu("h200-141gb", "141 GB HBM3e", _NV + "h200/", 143_771, NVML_TABLE),
    Gpu("a100-80gb", "80 GB HBM2e", _NV + "a100/", 81_920, NVML_TABLE),
    Gpu("a100-40gb", "40 GB HBM2", _NV + "a100/", 40_960, NVML_TABLE),
    Gpu("l40s-48gb", "48 GB GDDR6", _NV + "l40s/", 46_068, NVML_TABLE),
    Gpu("l4-24gb", "24 GB GDDR6", _NV + "l4/", 23_034, NVML_TABLE),
    Gpu("a10-24gb", "24 GB GDDR6", _NV + "products/a10-gpu/", 23_028, NVML_TABLE),
    Gpu("rtx4090-24gb", "24 GB GDDR6X", "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/",
        24_564, NVML_TABLE),
    Gpu("b200-180gb", "180 GB HBM3e per GPU (DGX B200: 1,440 GB over 8 GPUs)", _NV + "dgx-b200/", 183_359,
        "nvidia-smi on an idle B200 reads 183359MiB: https://github.com/NVIDIA/TensorRT-LLM/issues/10278"),
    Gpu("h100-nvl-94gb", "94 GB HBM3 (H100 NVL)", _NV + "h100/", 95_830,
        "nvidia-smi on an idle H100 NVL reads 95830MiB: https://github.com/NVIDIA/gpu-admin-tools/issues/4"),
    Gpu("mi300x-192gb", "192 GB HBM3", "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
        196_592, "rocminfo on an MI300X lists its global memory pool as 201310208 KB (196,592 MiB): "
        "https://github.com/ROCm/legacy-rocm-build/issues/4414; ROCm's HIP context stands in for CUDA's"),
    Gpu("rtx-a6000-48gb", "48 GB GDDR6 with ECC", "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/",
        49_140, NVML_TABLE),
)}
