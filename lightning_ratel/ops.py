"""Fused host-side Adam/AdamW step for the out-of-core optimizer.

:func:`fused_adamw_` reads each gradient once, updates the fp32 master weight and both moments in place and can
write the new weight straight into a 16-bit (or fp32) buffer for the next upload. It runs the compiled
``lightning_ratel._C`` kernel when the extension was built, and otherwise the same step with torch operations.

The native kernel follows torch's single-tensor ``torch.optim.Adam``/``AdamW`` (the CPU default) operation by
operation, rounding to float32 where torch does and fusing a multiply-add exactly where torch's kernels do. The one
difference is ``sqrt``: torch's float32 ``sqrt`` goes through MKL's vector math library, which is one ulp off the
correctly rounded result for some inputs, while the kernel uses the IEEE instruction (the same on every CPU). So
AdamW's moments come out bitwise equal to torch's, and a weight occasionally lands one rounding away (at the
magnitude of the weight or its update); with Adam's L2 term that difference also reaches the moments.
"""

from __future__ import annotations

import functools
import numbers

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim.adam import adam as _functional_adam
from torch.optim.adamw import adamw as _functional_adamw

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


def fused_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
) -> None:
    """Applies one Adam or AdamW step in place, in a single pass over host memory.

    The gradient is multiplied by the float32 reciprocal of ``grad_scale`` first, as
    ``torch.amp.GradScaler.unscale_`` does; it is never modified.

    Args:
        param: fp32 master weights, updated in place.
        grad: Gradient in fp32, bf16 or fp16.
        exp_avg: fp32 first moment, updated in place.
        exp_avg_sq: fp32 second moment, updated in place.
        param_out: Optional bf16, fp16 or fp32 buffer that receives the updated weights (round to nearest even).
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        weight_decay: Decay coefficient; decoupled (AdamW) or added to the gradient (Adam, L2).
        step: 1-based number of this step, for bias correction.
        decoupled: ``True`` for AdamW, ``False`` for Adam with L2 regularisation.
        grad_scale: Loss scale the gradient still carries.
        num_threads: Threads for the native kernel; defaults to ``torch.get_num_threads()``. The torch fallback
            always uses torch's own thread pool.

    Raises:
        TypeError: A tensor argument is not a tensor or has an unsupported dtype.
        ValueError: A tensor is not on the CPU, not contiguous or of the wrong size, or a scalar is out of range.
    """
    _validate(param, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
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
        _torch_step(
            param, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps, weight_decay, step, decoupled,
            inv_scale,
        )
        return

    _C.adamw(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        param.numel(),
        _DTYPE_CODES[grad.dtype],
        _C.NONE if param_out is None else _DTYPE_CODES[param_out.dtype],
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        int(step),
        bool(decoupled),
        inv_scale,
        int(num_threads),
    )
    # The kernel wrote through raw pointers; autograd must still see these tensors as modified in place. One call
    # per tensor because older torch releases take a single tensor here.
    for written in (param, exp_avg, exp_avg_sq, param_out):
        if written is not None:
            torch.autograd.graph.increment_version(written)


def torch_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool = True,
    grad_scale: float = 1.0,
) -> None:
    """The step of :func:`fused_adamw_` done by torch's own single-tensor Adam(W), bit for bit what
    ``torch.optim.AdamW`` computes on CPU; same arguments."""
    _validate(param, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    _torch_step(
        param, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps, weight_decay, step, decoupled,
        1.0 / grad_scale,
    )


@functools.cache
def native_matches_torch() -> bool:
    """Whether the native kernel reproduces :func:`torch_adamw_` bit for bit on this CPU (checked once).

    Training must end on the numbers of plain training, and Adam turns even one-ulp differences into visible ones
    on parameters whose gradient is almost zero, so callers that promise equality use the kernel only where it is
    exact. Says once when it is not.
    """
    if _C is None:
        return False
    gen = torch.Generator().manual_seed(0)
    n = 4099
    start = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * 1e-3
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    ref, mine = start.clone(), start.clone()
    ref_m, ref_v, m, v = (torch.zeros(n) for _ in range(4))
    for step in (1, 2, 3):
        torch_adamw_(ref, grad, ref_m, ref_v, None, step=step, **hyper)
        fused_adamw_(mine, grad, m, v, None, step=step, **hyper)
    exact = torch.equal(ref, mine) and torch.equal(ref_m, m) and torch.equal(ref_v, v)
    if not exact:
        rank_zero_warn(
            f"lightning_ratel: the native AdamW kernel ({isa()}) does not reproduce torch.optim.AdamW bit for bit "
            "on this CPU; the CPU optimizer uses torch's own AdamW instead."
        )
    return exact


def _validate(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float,
) -> None:
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_out is not None:
        tensors["param_out"] = param_out
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got device {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name in ("param", "exp_avg", "exp_avg_sq"):
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
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    if not 0.0 < grad_scale < float("inf"):
        raise ValueError(f"grad_scale must be positive and finite, got {grad_scale}")


def _torch_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool,
    inv_scale: float,
) -> None:
    # torch's single-tensor Adam, which is what torch.optim.AdamW runs on CPU by default, so that this path gives
    # exactly the numbers users compare against.
    with torch.no_grad():
        grad32 = grad.float()
        if inv_scale != 1.0:
            grad32 = grad32.mul_(inv_scale) if grad32 is not grad else grad32 * inv_scale
        # The functional API counts the step itself before using it.
        step_before = torch.tensor(float(step - 1), dtype=torch.float32)
        # Separate functions rather than adam(decoupled_weight_decay=...), which older torch releases lack.
        step_fn = _functional_adamw if decoupled else _functional_adam
        step_fn(
            [param],
            [grad32],
            [exp_avg],
            [exp_avg_sq],
            [],
            [step_before],
            foreach=False,
            fused=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=weight_decay,
            eps=eps,
            maximize=False,
        )
        if param_out is not None:
            param_out.copy_(param)
