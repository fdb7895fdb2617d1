"""Fused host-side Adam/AdamW step for the out-of-core optimizer.

:func:`fused_adamw_` reads each gradient once, updates the fp32 master weight and both moments (in place, or read
from one state slot and written to another in the same pass) and can write the new weight straight into a 16-bit (or
fp32) buffer for the next upload. It runs the compiled
``lightning_ratel._C`` kernel when the extension was built, and otherwise the same step with torch operations.

The native kernel follows torch's single-tensor ``torch.optim.Adam``/``AdamW`` (the CPU default) operation by
operation, rounding to float32 where torch does and fusing a multiply-add exactly where torch's kernels do. For
``sqrt`` it calls the very function torch's float32 ``sqrt`` calls: MKL's ``vmsSqrt`` inside torch's CPU library,
which is not correctly rounded and differs between CPUs, so no formula of our own could match it everywhere. Where
torch has no MKL, the kernel uses the correctly rounded instruction, as torch then does. :func:`native_matches_torch`
checks the result against torch once per process; callers that promise torch's numbers use the kernel only then.
"""

from __future__ import annotations

import ctypes
import functools
import numbers
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim.adam import adam as _functional_adam
from torch.optim.adamw import adamw as _functional_adamw

from lightning_ratel.runtime.checksum import blocks_of

try:
    from lightning_ratel import _C
except ImportError:
    _C = None

NATIVE_AVAILABLE: bool = _C is not None
"""Whether the compiled kernel was importable."""

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_CODES = (
    {torch.float32: _C.FLOAT32, torch.bfloat16: _C.BFLOAT16, torch.float16: _C.FLOAT16} if _C is not None else {}
)
_fallback_warned = False
_STATES = ("param", "exp_avg", "exp_avg_sq")

# The mode torch's at::vml::vsqrt passes to vmsSqrt: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
VML_SQRT_MODE = 0x2 | 0x140000 | 0x100


def torch_vml_sqrt() -> tuple[int, int]:
    """Finds the MKL ``vmsSqrt`` that torch's float32 CPU ``sqrt`` calls.

    Returns:
        ``(sqrt, threads_local)``: the address of ``vmsSqrt`` in torch's CPU library, or 0 where torch has no MKL
        vector math (macOS, builds without MKL) or the library or symbol cannot be found; and the address of the
        C ``mkl_set_num_threads_local`` beside it (``MKL_Set_Num_Threads_Local``; the lower-case symbol is the
        Fortran one, which takes a pointer), or 0.
    """
    if sys.platform == "darwin" or not torch.backends.mkl.is_available():
        return 0, 0
    try:
        # Already loaded by ``import torch``; this only returns its handle.
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        sqrt = ctypes.cast(library.vmsSqrt, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0, 0
    try:
        threads_local = ctypes.cast(library.MKL_Set_Num_Threads_Local, ctypes.c_void_p).value or 0
    except AttributeError:
        threads_local = 0
    return sqrt, threads_local


def set_native_sqrt(ieee: bool = False) -> None:
    """Chooses the square root the native kernel takes.

    Args:
        ieee: ``False`` for torch's own float32 ``sqrt`` (MKL's ``vmsSqrt`` where torch has it, else the IEEE
            instruction), as set at import; ``True`` for the correctly rounded instruction in a single fused pass.
    """
    if _C is not None:
        _C.set_sqrt(0 if ieee else _torch_sqrt, VML_SQRT_MODE, _mkl_threads_local)


_torch_sqrt, _mkl_threads_local = torch_vml_sqrt()
set_native_sqrt()
if _C is not None and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
    # torch's DEFAULT kernels never fuse a multiply with an add; the SIMD paths do, like torch's AVX2/AVX-512
    # kernels. Following torch keeps the results bitwise equal to its optimizers in this process.
    _C.set_isa("scalar")


def isa() -> str:
    """Names the code path :func:`fused_adamw_` takes.

    Returns:
        ``"avx512"``, ``"avx2"`` or ``"scalar"`` for the native kernel, ``"torch"`` for the fallback.
    """
    return _C.isa() if _C is not None else "torch"


@dataclass(frozen=True)
class GroupHyper:
    """The hyperparameters of an Adam or AdamW step: one parameter group's, read from the user's optimizer at the start
    of each step.

    Attributes:
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        weight_decay: Decay coefficient; decoupled (AdamW) or added to the gradient (Adam, L2).
        decoupled: ``True`` for AdamW, ``False`` for Adam with L2 regularisation.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> list[GroupHyper]:
        """The current hyperparameters of every group of a ``torch.optim.AdamW`` or ``torch.optim.Adam``."""
        decoupled_default = isinstance(optimizer, torch.optim.AdamW)
        hyper = []
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            hyper.append(cls(
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled=bool(group.get("decoupled_weight_decay", decoupled_default)),
            ))
        return hyper


def fused_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    hyper: GroupHyper,
    *,
    step: int,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
    param_src: torch.Tensor | None = None,
    exp_avg_src: torch.Tensor | None = None,
    exp_avg_sq_src: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
) -> bool:
    """Applies one Adam or AdamW step, in a single pass over host memory: in place, or from source states into
    ``param``, ``exp_avg`` and ``exp_avg_sq`` (the same numbers as copying the sources there first and stepping in
    place, without the copy's pass).

    The gradient is multiplied by the float32 reciprocal of ``grad_scale`` first, as
    ``torch.amp.GradScaler.unscale_`` does; it is never modified.

    Args:
        param: fp32 master weights, updated in place (or written from ``param_src``).
        grad: Gradient in fp32, bf16 or fp16.
        exp_avg: fp32 first moment, updated in place (or written from ``exp_avg_src``).
        exp_avg_sq: fp32 second moment, updated in place (or written from ``exp_avg_sq_src``).
        param_out: Optional bf16, fp16 or fp32 buffer that receives the updated weights (round to nearest even).
        hyper: The step's hyperparameters.
        step: 1-based number of this step, for bias correction.
        grad_scale: Loss scale the gradient still carries.
        num_threads: Threads for the native kernel; defaults to ``torch.get_num_threads()``. The torch fallback
            always uses torch's own thread pool.
        param_src: fp32 master weights the step reads instead of ``param`` (``None``: ``param`` itself); only read.
        exp_avg_src: The same for ``exp_avg``.
        exp_avg_sq_src: The same for ``exp_avg_sq``.
        sums: An int64 tensor of shape ``(3, ceil(param.numel() * 4 / 4096))`` that receives, where the native kernel
            runs, the :data:`~lightning_ratel.runtime.checksum.WEIGHTED32` checksums of each 4096-byte block of the
            new ``param``, ``exp_avg`` and ``exp_avg_sq`` (as keys of their own), summed while the values are still
            in registers.

    Returns:
        Whether ``sums`` was filled (never without the native kernel).

    Raises:
        TypeError: A tensor argument is not a tensor or has an unsupported dtype.
        ValueError: A tensor is not on the CPU, not contiguous or of the wrong size, a source overlaps a destination
            without being that destination, or a scalar is out of range.
    """
    sources = _sources(param, exp_avg, exp_avg_sq, param_src, exp_avg_src, exp_avg_sq_src)
    _validate(param, grad, exp_avg, exp_avg_sq, param_out, hyper, step, grad_scale, sources)
    if num_threads is None:
        num_threads = torch.get_num_threads()
    elif num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    inv_scale = 1.0 / grad_scale

    if _C is None:
        global _fallback_warned
        if not _fallback_warned:
            rank_zero_warn(
                "lightning_ratel._C is not built (no C compiler with OpenMP at install time?); the CPU optimizer falls"
                " back to torch operations, which take several passes over memory and are slower."
            )
            _fallback_warned = True
        _torch_step(param, grad, exp_avg, exp_avg_sq, param_out, hyper, step, inv_scale, sources)
        return False
    if sums is not None:
        blocks = blocks_of(param.numel() * 4)
        if sums.dtype != torch.int64 or sums.device.type != "cpu" or not sums.is_contiguous() or sums.shape != (
                3, blocks):
            raise ValueError(f"sums must be a contiguous CPU int64 tensor of shape (3, {blocks}), got {sums.dtype} "
                             f"{tuple(sums.shape)} on {sums.device}")

    _C.adamw(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        param.numel(),
        _DTYPE_CODES[grad.dtype],
        _C.NONE if param_out is None else _DTYPE_CODES[param_out.dtype],
        float(hyper.lr),
        float(hyper.beta1),
        float(hyper.beta2),
        float(hyper.eps),
        float(hyper.weight_decay),
        int(step),
        bool(hyper.decoupled),
        inv_scale,
        int(num_threads),
        src_param=sources[0].data_ptr(),
        src_exp_avg=sources[1].data_ptr(),
        src_exp_avg_sq=sources[2].data_ptr(),
        sums=0 if sums is None else sums.data_ptr(),
    )
    # The kernel wrote through raw pointers; autograd must still see these tensors as modified in place. One call
    # per tensor because older torch releases take a single tensor here.
    for written in (param, exp_avg, exp_avg_sq, param_out):
        if written is not None:
            torch.autograd.graph.increment_version(written)
    return sums is not None


def torch_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    hyper: GroupHyper,
    *,
    step: int,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
    param_src: torch.Tensor | None = None,
    exp_avg_src: torch.Tensor | None = None,
    exp_avg_sq_src: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
) -> bool:
    """The step of :func:`fused_adamw_` done by torch's own single-tensor Adam(W), bit for bit what
    ``torch.optim.AdamW`` computes on CPU; same arguments (``num_threads`` is accepted and ignored: torch's own
    thread pool runs it, sized by the calling thread's ``torch.set_num_threads``; sources are copied into their
    destinations first; ``sums`` is never filled, so it returns ``False``)."""
    sources = _sources(param, exp_avg, exp_avg_sq, param_src, exp_avg_src, exp_avg_sq_src)
    _validate(param, grad, exp_avg, exp_avg_sq, param_out, hyper, step, grad_scale, sources)
    _torch_step(param, grad, exp_avg, exp_avg_sq, param_out, hyper, step, 1.0 / grad_scale, sources)
    return False


def device_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    outs: list[torch.Tensor],
    hyper: GroupHyper,
    *,
    step: int,
    sources: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> None:
    """One Adam or AdamW step of every tensor of ``params`` (fp32, on one device, all at step count ``step``), in place
    or from ``sources`` (masters, first and second moments the step reads, one per tensor of ``params``; none may
    overlap a destination), each result also written into the same-sized tensor of ``outs`` (its compute copy, in its
    own dtype): the device tier's update, on the training thread. On a GPU it is a foreach copy of the sources, then
    torch's foreach AdamW over the list, what ``torch.optim.AdamW`` runs there by default, then one foreach copy into
    ``outs``. On the CPU it is the CPU optimizer's step (:func:`adamw_step`): the native kernel, one pass over memory
    that reads the sources and writes ``outs`` too, where it reproduces torch's single-tensor AdamW
    (``torch.optim.AdamW``'s default there) bit for bit, else that one."""
    if params[0].device.type != "cuda":
        step_fn = adamw_step()
        per_tensor = zip(*sources) if sources is not None else ((None, None, None) for _ in params)
        for param, grad, exp_avg, exp_avg_sq, out, (param_src, exp_avg_src, exp_avg_sq_src) in zip(
                params, grads, exp_avgs, exp_avg_sqs, outs, per_tensor):
            step_fn(param, grad, exp_avg, exp_avg_sq, out, hyper, step=step, param_src=param_src,
                    exp_avg_src=exp_avg_src, exp_avg_sq_src=exp_avg_sq_src)
        return
    with torch.no_grad():
        if sources is not None:
            pairs = [(dst, src) for dst, src in zip([*params, *exp_avgs, *exp_avg_sqs], [t for c in sources for t in c])
                     if src.data_ptr() != dst.data_ptr()]
            if pairs:
                torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
        _functional_step(params, [grad.float() for grad in grads], exp_avgs, exp_avg_sqs, hyper, step, foreach=True)
        torch._foreach_copy_(outs, params)


def adamw_step() -> Callable[..., None]:
    """The AdamW step the CPU optimizer runs: the native kernel where it reproduces torch exactly, else torch's.

    Plain training's numbers are the contract, so the fast kernel is used only where the check passes.
    """
    return fused_adamw_ if native_matches_torch() else torch_adamw_


@functools.cache
def native_matches_torch() -> bool:
    """Whether the native kernel reproduces :func:`torch_adamw_` bit for bit on this CPU (checked once).

    Training must end on the numbers of plain training, and Adam turns even one-ulp differences into visible ones
    on parameters whose gradient is almost zero, so callers that promise equality use the kernel only where it is
    exact. The check tries torch's MKL ``vmsSqrt`` first and the correctly rounded ``sqrt`` second, keeps the first
    one under which the kernel's square roots equal ``torch.sqrt`` and a few steps equal torch's, and says once when
    neither does.
    """
    if _C is None:
        return False
    for ieee in (False, True) if _torch_sqrt else (True,):
        set_native_sqrt(ieee)
        if _sqrt_matches_torch() and _steps_match_torch():
            return True
    set_native_sqrt()
    rank_zero_warn(
        f"lightning_ratel: the native AdamW kernel ({isa()}) does not reproduce torch.optim.AdamW bit for bit "
        "on this CPU; the CPU optimizer uses torch's own AdamW instead."
    )
    return False


def _sqrt_matches_torch() -> bool:
    gen = torch.Generator().manual_seed(0)
    # Random bit patterns reach every exponent, subnormals, inf and NaNs; exp_avg_sq is never negative.
    probe = torch.randint(0, 0x7FFFFFFF, (1 << 16,), dtype=torch.int32, generator=gen).view(torch.float32)
    roots = torch.empty_like(probe)
    _C.sqrt(probe.data_ptr(), roots.data_ptr(), probe.numel())
    return _same_bits(roots, torch.sqrt(probe))


def _steps_match_torch() -> bool:
    gen = torch.Generator().manual_seed(0)
    n = 4099
    start = torch.randn(n, generator=gen)
    # Gradients over many magnitudes, some zero: tiny ones are where Adam amplifies a difference in sqrt.
    grad = torch.randn(n, generator=gen) * torch.logspace(-12, 0, n).index_select(0, torch.randperm(n, generator=gen))
    grad[::97] = 0.0
    for decoupled, grad_dtype, out_dtype, grad_scale in (
        (True, torch.float32, None, 1.0),
        (False, torch.bfloat16, torch.bfloat16, 1024.0),
    ):
        hyper = GroupHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=decoupled)
        g = (grad * grad_scale).to(grad_dtype)
        ref, mine = start.clone(), start.clone()
        ref_m, ref_v, m, v = (torch.zeros(n) for _ in range(4))
        ref_out, out = (None, None) if out_dtype is None else (torch.empty(n, dtype=out_dtype) for _ in range(2))
        for step in (1, 2, 3):
            torch_adamw_(ref, g, ref_m, ref_v, ref_out, hyper, step=step, grad_scale=grad_scale)
            fused_adamw_(mine, g, m, v, out, hyper, step=step, grad_scale=grad_scale)
        pairs = [(ref, mine), (ref_m, m), (ref_v, v)] + ([] if out is None else [(ref_out, out)])
        if not all(_same_bits(a, b) for a, b in pairs):
            return False
    return True


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bits, not values: torch.equal calls NaN unequal to itself and -0.0 equal to 0.0.
    int_type = torch.int32 if a.element_size() == 4 else torch.int16
    return a.dtype == b.dtype and torch.equal(a.view(int_type), b.view(int_type))


def _validate(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    hyper: GroupHyper,
    step: int,
    grad_scale: float,
    sources: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_out is not None:
        tensors["param_out"] = param_out
    tensors.update({f"{name}_src": src for name, src in zip(_STATES, sources)})
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got device {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name in (*_STATES, *(f"{name}_src" for name in _STATES)):
        if tensors[name].dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32, got {tensors[name].dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
    if param_out is not None and param_out.dtype not in _OUT_DTYPES:
        raise TypeError(f"param_out must be bfloat16, float16 or float32, got {param_out.dtype}")
    numel = param.numel()
    for name, tensor in tensors.items():
        if tensor.numel() != numel:
            raise ValueError(f"{name} has {tensor.numel()} elements but param has {numel}")
    # The step reads a source element after it wrote the destination's earlier ones: a source is its own destination
    # or shares no byte with any destination (the 16-bit copy included).
    destinations = [(name, tensors[name]) for name in (*_STATES, "param_out") if name in tensors]
    for name, src in zip(_STATES, sources):
        for other, dst in destinations:
            if not (other == name and src.data_ptr() == dst.data_ptr()) and _overlap(src, dst):
                raise ValueError(f"{name}_src overlaps {other} without being it")
    if not hyper.lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {hyper.lr}")
    if not (0.0 <= hyper.beta1 < 1.0 and 0.0 <= hyper.beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got ({hyper.beta1}, {hyper.beta2})")
    if not hyper.eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {hyper.eps}")
    if not hyper.weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {hyper.weight_decay}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    if not 0.0 < grad_scale < float("inf"):
        raise ValueError(f"grad_scale must be positive and finite, got {grad_scale}")


def _sources(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, param_src: torch.Tensor | None,
             exp_avg_src: torch.Tensor | None, exp_avg_sq_src: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The states a step reads: each given source, else its destination (in place)."""
    return (param if param_src is None else param_src, exp_avg if exp_avg_src is None else exp_avg_src,
            exp_avg_sq if exp_avg_sq_src is None else exp_avg_sq_src)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share a byte."""
    a_bytes, b_bytes = a.numel() * a.element_size(), b.numel() * b.element_size()
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return 0 < a_bytes and 0 < b_bytes and a_start < b_start + b_bytes and b_start < a_start + a_bytes


def _torch_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    hyper: GroupHyper,
    step: int,
    inv_scale: float,
    sources: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    # torch's single-tensor Adam, which is what torch.optim.AdamW runs on CPU by default, so that this path gives
    # exactly the numbers users compare against.
    with torch.no_grad():
        for state, src in zip((param, exp_avg, exp_avg_sq), sources):
            if src.data_ptr() != state.data_ptr():
                state.copy_(src)
        grad32 = grad.float()
        if inv_scale != 1.0:
            grad32 = grad32.mul_(inv_scale) if grad32 is not grad else grad32 * inv_scale
        _functional_step([param], [grad32], [exp_avg], [exp_avg_sq], hyper, step, foreach=False)
        if param_out is not None:
            param_out.copy_(param)


def _functional_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], hyper: GroupHyper, step: int, *, foreach: bool) -> None:
    """Torch's own Adam or AdamW step of ``params`` (fp32 gradients, all at step count ``step``), in place: foreach
    over the list or single-tensor, tensor by tensor, as ``torch.optim.AdamW`` chooses on the device."""
    # Separate functions rather than adam(decoupled_weight_decay=...), which older torch releases lack.
    step_fn = _functional_adamw if hyper.decoupled else _functional_adam
    step_fn(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        # The functional API counts the step itself before using it.
        [torch.tensor(float(step - 1), dtype=torch.float32) for _ in params],
        foreach=foreach,
        fused=False,
        amsgrad=False,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        lr=hyper.lr,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        maximize=False,
    )
