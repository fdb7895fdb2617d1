"""Tests of the fused host-side Adam/AdamW step (lightning_ratel.runtime.adamw and the lightning_ratel._C kernel)."""

from __future__ import annotations

import ctypes
import importlib
import inspect
import os
import platform
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from lightning_ratel.runtime import adamw as ops
from lightning_ratel.runtime import checksum

SIZES = (1, 7, 15, 16, 17, 1023, 100_003)
OFFSETS = (0, 1, 3)
LRS = (1e-3, 3e-3, 5e-4, 2e-3, 1e-4)
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
ISAS = ("avx512", "avx2", "scalar")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype
    mismatch = (_bits(actual) != _bits(expected)).nonzero()
    assert mismatch.numel() == 0, (
        f"{what}: {mismatch.numel()} of {actual.numel()} elements differ, first at {mismatch[0].item()}: "
        f"{actual.flatten()[mismatch[0]].item()!r} vs {expected.flatten()[mismatch[0]].item()!r}"
    )


def _slice(full: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """A contiguous view that starts ``offset`` elements into its storage, so the kernel sees unaligned data."""
    return full[offset : offset + n]


def _state(n: int, grad_dtype: torch.dtype, offset: int, seed: int, fresh_moments: bool):
    gen = torch.Generator().manual_seed(seed)
    param = _slice(torch.empty(n + offset), offset, n).copy_(torch.randn(n, generator=gen))
    exp_avg = _slice(torch.empty(n + offset), offset, n)
    exp_avg_sq = _slice(torch.empty(n + offset), offset, n)
    if fresh_moments:
        exp_avg.zero_()
        exp_avg_sq.zero_()
    else:
        exp_avg.copy_(torch.randn(n, generator=gen) * 0.01)
        exp_avg_sq.copy_(torch.rand(n, generator=gen) * 1e-4)
    grads = []
    for _ in LRS:
        grad = _slice(torch.empty(n + offset, dtype=grad_dtype), offset, n)
        grads.append(grad.copy_(torch.randn(n, generator=gen) * 0.1))
    return param, exp_avg, exp_avg_sq, grads


def _reference_step(param, grad32, exp_avg, exp_avg_sq, *, lr, step, decoupled, torch_kernels, torch_sqrt):
    """torch's ``_single_tensor_adam`` line by line.

    With ``torch_kernels`` the fused operations are torch's own (``lerp_``, ``addcmul_``, ``add(alpha=)``), which
    round like one FMA on AVX2/AVX-512 builds; without it they are split into separately rounded steps, which is
    what torch's DEFAULT kernels compute. With ``torch_sqrt`` the square root is ``torch.sqrt`` (MKL's where torch
    has it), else the correctly rounded one.
    """
    beta1, beta2 = BETAS
    if decoupled:
        param.mul_(1 - lr * WEIGHT_DECAY)
    elif torch_kernels:
        grad32 = grad32.add(param, alpha=WEIGHT_DECAY)
    else:
        grad32 = grad32 + param * WEIGHT_DECAY
    if torch_kernels:
        exp_avg.lerp_(grad32, 1 - beta1)
    else:
        weight = torch.tensor(1 - beta1, dtype=torch.float32)
        diff = grad32 - exp_avg
        if weight < 0.5:
            exp_avg.add_(diff * weight.item())
        else:
            exp_avg.copy_(grad32 - diff * (1 - weight).item())
    exp_avg_sq.mul_(beta2)
    if torch_kernels:
        exp_avg_sq.addcmul_(grad32, grad32, value=1 - beta2)
    else:
        exp_avg_sq.add_(grad32 * (1 - beta2) * grad32)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    # sqrt in double, then rounded once to float32, is the correctly rounded float32 sqrt.
    root = exp_avg_sq.sqrt() if torch_sqrt else exp_avg_sq.double().sqrt().float()
    denom = (root / bias_correction2_sqrt).add_(EPS)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _fused(param, grad, exp_avg, exp_avg_sq, out, *, lr, step, decoupled, grad_scale=1.0, num_threads=None):
    hyper = ops.GroupHyper(lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
                           decoupled=decoupled)
    ops.fused_adamw_(
        param, grad, exp_avg, exp_avg_sq, out, hyper, step=step, grad_scale=grad_scale, num_threads=num_threads
    )


@pytest.fixture(params=ISAS)
def native_isa(request):
    """Forces one native code path for the test and restores the automatic choice afterwards."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    saved = ops._C.isa()
    if not ops._C.set_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    ops._C.set_isa(saved)


@pytest.fixture(params=["torch", "ieee"])
def native_sqrt(request):
    """Makes the kernel take torch's own sqrt (MKL's vmsSqrt where torch has it) or the correctly rounded one for
    the test; yields whether the reference must use ``torch.sqrt``."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    ops.set_native_sqrt(ieee=request.param == "ieee")
    yield request.param == "torch"
    ops.set_native_sqrt()


def _uses_torch_fma(isa: str) -> bool:
    """Whether ``isa`` rounds like torch's FMA kernels (AVX2/AVX-512) rather than its DEFAULT ones."""
    if isa == "scalar":
        return False
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch runs its DEFAULT kernels here, so it cannot provide the FMA reference")
    return True


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_bitwise_equal_to_torch_ops(native_isa, native_sqrt, decoupled, grad_dtype):
    torch_kernels = _uses_torch_fma(native_isa)
    out_dtypes = (None, torch.bfloat16, torch.float16, torch.float32)
    for case, (n, offset) in enumerate((n, o) for n in SIZES for o in OFFSETS):
        param, exp_avg, exp_avg_sq, grads = _state(n, grad_dtype, offset, seed=case, fresh_moments=False)
        ref_param, ref_avg, ref_avg_sq = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
        out_dtype = out_dtypes[case % len(out_dtypes)]
        out = None if out_dtype is None else _slice(torch.empty(n + 2, dtype=out_dtype), 2, n)
        for step, (lr, grad) in enumerate(zip(LRS, grads), start=1):
            _fused(param, grad, exp_avg, exp_avg_sq, out, lr=lr, step=step, decoupled=decoupled)
            _reference_step(
                ref_param, grad.float(), ref_avg, ref_avg_sq, lr=lr, step=step, decoupled=decoupled,
                torch_kernels=torch_kernels, torch_sqrt=native_sqrt,
            )
            where = f"n={n} offset={offset} step={step}"
            assert_bitwise(exp_avg, ref_avg, f"exp_avg {where}")
            assert_bitwise(exp_avg_sq, ref_avg_sq, f"exp_avg_sq {where}")
            assert_bitwise(param, ref_param, f"param {where}")
            if out is not None:
                assert_bitwise(out, param.to(out_dtype), f"param_out {where}")


def _wide_grads(n: int, grad_dtype: torch.dtype, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    """Gradients over twelve decades with some exact zeros, at an unaligned offset: tiny gradients are where Adam
    turns a one-ulp difference in sqrt into a visible one."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in LRS:
        magnitude = 10.0 ** (torch.rand(n, generator=gen) * 12 - 12)
        grad = torch.randn(n, generator=gen) * magnitude * scale
        grad[torch.rand(n, generator=gen) < 0.01] = 0.0
        grads.append(_slice(torch.empty(n + 1, dtype=grad_dtype), 1, n).copy_(grad))
    return grads


@pytest.mark.parametrize("simd", ["avx512", "avx2"])
@pytest.mark.parametrize("n", [1, 15, 4097, 100_003])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_matches_torch_optimizer_bitwise(simd, n, decoupled, grad_dtype):
    """The engine's contract: as configured at import, the kernel gives torch.optim.AdamW/Adam's (single-tensor)
    numbers bit for bit, moments and copies included, on fresh draws unlike those of the import-time check."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch runs its DEFAULT kernels here; the scalar path is checked against them separately")
    saved = ops._C.isa()
    if not ops._C.set_isa(simd):
        pytest.skip(f"this CPU has no {simd}")
    try:
        seed = 1000 + n + 10 * decoupled
        scale = 4096.0 if grad_dtype == torch.float16 else 1.0  # fp16 gradients carry a loss scale
        grads = _wide_grads(n, grad_dtype, seed, scale)
        gen = torch.Generator().manual_seed(seed)
        param = _slice(torch.empty(n + 3), 3, n).copy_(torch.randn(n, generator=gen))
        exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
        out_dtype = (None, torch.bfloat16, torch.float16)[n % 3]
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        torch_param = torch.nn.Parameter(param.clone())
        optimizer_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        optimizer = optimizer_cls(
            [torch_param], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False
        )
        inv_scale = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()  # as GradScaler
        for step, (lr, grad) in enumerate(zip(LRS, grads), start=1):
            _fused(param, grad, exp_avg, exp_avg_sq, out, lr=lr, step=step, decoupled=decoupled, grad_scale=scale)
            optimizer.param_groups[0]["lr"] = lr
            torch_param.grad = grad.float() * inv_scale
            optimizer.step()
            state = optimizer.state[torch_param]
            assert_bitwise(param, torch_param.detach(), f"param step {step}")
            assert_bitwise(exp_avg, state["exp_avg"], f"exp_avg step {step}")
            assert_bitwise(exp_avg_sq, state["exp_avg_sq"], f"exp_avg_sq step {step}")
            if out is not None:
                assert_bitwise(out, torch_param.detach().to(out_dtype), f"param_out step {step}")
    finally:
        ops._C.set_isa(saved)


def test_threads_match_torch_optimizer():
    """Several threads, each with chunks and its own partial last vector, still give torch's numbers."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    n = 3 * 32768 + 77
    grads = _wide_grads(n, torch.bfloat16, seed=31)
    param = torch.randn(n, generator=torch.Generator().manual_seed(31))
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    torch_param = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([torch_param], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    for step, (lr, grad) in enumerate(zip(LRS, grads), start=1):
        _fused(param, grad, exp_avg, exp_avg_sq, None, lr=lr, step=step, decoupled=True, num_threads=3)
        optimizer.param_groups[0]["lr"] = lr
        torch_param.grad = grad.float()
        optimizer.step()
    assert_bitwise(param, torch_param.detach(), "param")
    assert_bitwise(exp_avg_sq, optimizer.state[torch_param]["exp_avg_sq"], "exp_avg_sq")


def test_native_matches_torch_here():
    """On an x86 CPU with the kernel built, the import-time configuration reproduces torch and says nothing."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("exactness is only promised on x86-64")
    ops.native_matches_torch.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.native_matches_torch() is True


def test_native_check_rejects_a_different_sqrt(monkeypatch):
    """Where torch's sqrt is MKL's, the correctly rounded one differs from it; the check must see that, warn, and
    leave the kernel configured with torch's sqrt."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    if not ops.torch_vml_sqrt()[0]:
        pytest.skip("torch has no MKL vmsSqrt here")
    monkeypatch.setattr(ops, "_torch_sqrt", 0)
    ops.native_matches_torch.cache_clear()
    try:
        with pytest.warns(UserWarning, match="does not reproduce torch.optim.AdamW"):
            assert ops.native_matches_torch() is False
    finally:
        monkeypatch.undo()
        ops.set_native_sqrt()
        ops.native_matches_torch.cache_clear()
    assert ops.native_matches_torch() is True


def test_kernel_restores_mkl_thread_setting():
    """The kernel keeps MKL's vmsSqrt on each calling thread and then gives the caller's thread its own setting back,
    so torch's MKL calls on that thread afterwards are threaded as before."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    sqrt, threads_local = ops.torch_vml_sqrt()
    if not (sqrt and threads_local):
        pytest.skip("torch has no MKL vmsSqrt and mkl_set_num_threads_local here")
    set_local = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(threads_local)
    before = set_local(3)
    try:
        param, exp_avg, exp_avg_sq, grads = _state(4099, torch.float32, 0, seed=4, fresh_moments=True)
        _fused(param, grads[0], exp_avg, exp_avg_sq, None, lr=1e-3, step=1, decoupled=True, num_threads=1)
        roots = torch.empty(300)
        ops._C.sqrt(exp_avg_sq.data_ptr(), roots.data_ptr(), 300)
    finally:
        assert set_local(before) == 3


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 70_001])
def test_kernel_sqrt_is_torch_sqrt(n):
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    gen = torch.Generator().manual_seed(n + 5)
    probe = torch.randint(0, 0x7FFFFFFF, (n + 1,), dtype=torch.int32, generator=gen).view(torch.float32)[1:]
    roots = torch.empty(n + 2)[2:]
    ops._C.sqrt(probe.data_ptr(), roots.data_ptr(), n)
    assert_bitwise(roots, torch.sqrt(probe), "sqrt")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_param_out_rounds_like_torch(native_isa, out_dtype):
    gen = torch.Generator().manual_seed(3)
    random_bits = torch.randint(-(2**31), 2**31, (4093,), dtype=torch.int32, generator=gen).view(torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, tiny, 65504.0, 65519.99, 65520.0,
         -65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-14 - 2.0**-25, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
         1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 3.4e38, -3.4e38]
    )
    param = torch.cat([special, random_bits, torch.randn(1000, generator=gen)])
    n = param.numel()
    grad = torch.ones(n)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    # lr = 0 leaves every weight as it was, so the copy sees all of the values above.
    hyper = ops.GroupHyper(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    ops.fused_adamw_(param, grad, exp_avg, exp_avg_sq, out, hyper, step=1)
    expected = param.to(out_dtype)
    # Which NaN a bf16 copy holds differs between torch versions; that it is a NaN is what counts.
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert_bitwise(out[~nan], expected[~nan], f"{out_dtype} copy")


def test_grad_scale_multiplies_by_float32_reciprocal(native_isa, native_sqrt):
    torch_kernels = _uses_torch_fma(native_isa)
    scale = 3.0 * 2.0**13  # not a power of two, so the reciprocal is rounded
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        param, exp_avg, exp_avg_sq, grads = _state(1029, grad_dtype, 3, seed=11, fresh_moments=False)
        grads = [(g.float() * scale).to(grad_dtype) for g in grads]
        ref_param, ref_avg, ref_avg_sq = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
        inv_scale = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()  # as GradScaler
        for step, (lr, grad) in enumerate(zip(LRS, grads), start=1):
            _fused(param, grad, exp_avg, exp_avg_sq, None, lr=lr, step=step, decoupled=True, grad_scale=scale)
            _reference_step(
                ref_param, grad.float() * inv_scale, ref_avg, ref_avg_sq, lr=lr, step=step, decoupled=True,
                torch_kernels=torch_kernels, torch_sqrt=native_sqrt,
            )
        assert_bitwise(param, ref_param, f"param, {grad_dtype} grad")
        assert_bitwise(exp_avg, ref_avg, f"exp_avg, {grad_dtype} grad")
        assert_bitwise(exp_avg_sq, ref_avg_sq, f"exp_avg_sq, {grad_dtype} grad")


def test_lerp_weight_above_half(native_isa):
    """beta1 < 0.5 makes torch's lerp switch to its other formula."""
    torch_kernels = _uses_torch_fma(native_isa)
    param, exp_avg, exp_avg_sq, grads = _state(1001, torch.float32, 1, seed=5, fresh_moments=False)
    ref_avg = exp_avg.clone()
    hyper = ops.GroupHyper(lr=1e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    ops.fused_adamw_(param, grads[0], exp_avg, exp_avg_sq, None, hyper, step=1)
    if torch_kernels:
        ref_avg.lerp_(grads[0], 1 - 0.3)
    else:
        weight = torch.tensor(1 - 0.3, dtype=torch.float32)
        ref_avg = grads[0] - (grads[0] - ref_avg) * (1 - weight).item()
    assert_bitwise(exp_avg, ref_avg, "exp_avg")


@pytest.mark.parametrize("num_threads", [2, 3])
def test_thread_count_does_not_change_results(num_threads):
    n = 3 * 32768 + 77  # enough for three threads, with a tail in the last range
    results = []
    for threads in (1, num_threads):
        param, exp_avg, exp_avg_sq, grads = _state(n, torch.bfloat16, 1, seed=9, fresh_moments=False)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step, (lr, grad) in enumerate(zip(LRS, grads), start=1):
            _fused(param, grad, exp_avg, exp_avg_sq, out, lr=lr, step=step, decoupled=True, num_threads=threads)
        results.append((param, exp_avg, exp_avg_sq, out))
    for single, multi in zip(*results):
        assert_bitwise(multi, single, f"{num_threads} threads")


def test_scalar_path_matches_torch_default_kernels():
    """In a process where torch runs its DEFAULT (no FMA) kernels, the scalar path equals them bitwise."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    # The helpers travel as source and the extension is loaded from its file, so the child imports only torch
    # and the kernel, not the package (which pulls in lightning).
    helpers = "\n\n".join(
        inspect.getsource(f) for f in (_bits, assert_bitwise, _slice, _state, _reference_step, ops.torch_vml_sqrt)
    )
    script = textwrap.dedent(
        f"""
        import ctypes
        import importlib.util
        import os
        import sys
        import torch
        spec = importlib.util.spec_from_file_location("lightning_ratel._C", {ops._C.__file__!r})
        _C = importlib.util.module_from_spec(spec)
        LRS, BETAS, EPS, WEIGHT_DECAY = {LRS!r}, {BETAS!r}, {EPS!r}, {WEIGHT_DECAY!r}
        """
    ) + helpers + textwrap.dedent(
        f"""
        assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
        assert _C.set_isa("scalar")
        # torch's DEFAULT build still takes its sqrt from MKL where it has it.
        _C.set_sqrt(torch_vml_sqrt()[0], {ops.VML_SQRT_MODE}, torch_vml_sqrt()[1])
        """
    ) + textwrap.dedent(
        """
        for decoupled in (True, False):
            param, exp_avg, exp_avg_sq, grads = _state(1037, torch.bfloat16, 1, seed=13, fresh_moments=False)
            ref_param, ref_avg, ref_avg_sq = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
            for step, (lr, grad) in enumerate(zip(LRS, grads), start=1):
                _C.adamw(
                    param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), 0, param.numel(),
                    _C.BFLOAT16, _C.NONE, lr, BETAS[0], BETAS[1], EPS, WEIGHT_DECAY, step, decoupled, 1.0, 1,
                )
                _reference_step(
                    ref_param, grad.float(), ref_avg, ref_avg_sq, lr=lr, step=step, decoupled=decoupled,
                    torch_kernels=True, torch_sqrt=True,
                )
            assert_bitwise(param, ref_param, "param")
            assert_bitwise(exp_avg, ref_avg, "exp_avg")
            assert_bitwise(exp_avg_sq, ref_avg_sq, "exp_avg_sq")
        """
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_follows_torch_default_capability(monkeypatch):
    """When torch runs its DEFAULT kernels, ops switches the native kernel to the scalar path to match them."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    saved = ops._C.isa()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    try:
        importlib.reload(ops)
        assert ops.isa() == "scalar"
    finally:
        monkeypatch.undo()
        ops._C.set_isa(saved)
        importlib.reload(ops)
    assert ops.isa() == saved


def test_isa_selection():
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    assert ops.isa() in ISAS
    saved = ops._C.isa()
    try:
        assert ops._C.set_isa("scalar") is True
        assert ops.isa() == "scalar"
        for name in ("avx512", "avx2"):
            if ops._C.set_isa(name):
                assert ops.isa() == name
            else:
                assert ops.isa() != name
        with pytest.raises(ValueError, match="unknown ISA"):
            ops._C.set_isa("sse9")
    finally:
        ops._C.set_isa(saved)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_fallback_equals_torch_optimizer(monkeypatch, decoupled):
    monkeypatch.setattr(ops, "_C", None)
    monkeypatch.setattr(ops, "_fallback_warned", False)
    assert ops.isa() == "torch"
    n = 1027
    param, exp_avg, exp_avg_sq, grads = _state(n, torch.bfloat16, 1, seed=17, fresh_moments=True)
    scale = 1024.0
    grads = [(g.float() * scale).to(torch.bfloat16) for g in grads]
    torch_param = torch.nn.Parameter(param.clone())
    optimizer_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = optimizer_cls([torch_param], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)
    out = torch.empty(n, dtype=torch.float16)
    grads_before = [g.clone() for g in grads]
    for step, (lr, grad) in enumerate(zip(LRS, grads), start=1):
        if step == 1:
            with pytest.warns(UserWarning, match="falls back to torch"):
                _fused(param, grad, exp_avg, exp_avg_sq, out, lr=lr, step=step, decoupled=decoupled, grad_scale=scale)
        else:
            _fused(param, grad, exp_avg, exp_avg_sq, out, lr=lr, step=step, decoupled=decoupled, grad_scale=scale)
        optimizer.param_groups[0]["lr"] = lr
        torch_param.grad = grad.float() * (1.0 / scale)
        optimizer.step()
    state = optimizer.state[torch_param]
    assert_bitwise(param, torch_param.detach(), "param")
    assert_bitwise(exp_avg, state["exp_avg"], "exp_avg")
    assert_bitwise(exp_avg_sq, state["exp_avg_sq"], "exp_avg_sq")
    assert_bitwise(out, param.half(), "param_out")
    for grad, before in zip(grads, grads_before):
        assert_bitwise(grad, before, "grad must not change")


def test_fallback_warns_once(monkeypatch, recwarn):
    monkeypatch.setattr(ops, "_C", None)
    monkeypatch.setattr(ops, "_fallback_warned", False)
    param, exp_avg, exp_avg_sq, grads = _state(9, torch.float32, 0, seed=1, fresh_moments=True)
    for step in (1, 2, 3):
        _fused(param, grads[0], exp_avg, exp_avg_sq, None, lr=1e-3, step=step, decoupled=True)
    assert len([w for w in recwarn if "falls back to torch" in str(w.message)]) == 1


def test_native_does_not_touch_grad_and_bumps_versions():
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    param, exp_avg, exp_avg_sq, grads = _state(100, torch.float32, 0, seed=2, fresh_moments=True)
    grad_before = grads[0].clone()
    versions = [t._version for t in (param, exp_avg, exp_avg_sq)]
    _fused(param, grads[0], exp_avg, exp_avg_sq, None, lr=1e-3, step=1, decoupled=True, grad_scale=8.0)
    assert_bitwise(grads[0], grad_before, "grad")
    assert all(t._version > v for t, v in zip((param, exp_avg, exp_avg_sq), versions))


def test_empty_tensors():
    empty = torch.empty(0)
    hyper = ops.GroupHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    ops.fused_adamw_(empty, empty.clone(), empty.clone(), empty.clone(), torch.empty(0, dtype=torch.bfloat16), hyper,
                     step=1)


def _valid(n: int = 8) -> dict:
    return dict(
        param=torch.zeros(n), grad=torch.zeros(n, dtype=torch.bfloat16), exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n), param_out=torch.empty(n, dtype=torch.bfloat16),
    )


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"param": [0.0] * 8}, TypeError, "param must be a torch.Tensor"),
        ({"param": torch.zeros(8, dtype=torch.float64)}, TypeError, "param must be torch.float32"),
        ({"exp_avg": torch.zeros(8, dtype=torch.bfloat16)}, TypeError, "exp_avg must be torch.float32"),
        ({"exp_avg_sq": torch.zeros(8, dtype=torch.float16)}, TypeError, "exp_avg_sq must be torch.float32"),
        ({"grad": torch.zeros(8, dtype=torch.float64)}, TypeError, "grad must be float32, bfloat16 or float16"),
        ({"grad": torch.zeros(8, dtype=torch.int32)}, TypeError, "grad must be"),
        ({"param_out": torch.zeros(8, dtype=torch.int8)}, TypeError, "param_out must be"),
        ({"grad": torch.zeros(9, dtype=torch.bfloat16)}, ValueError, "grad has 9 elements but param has 8"),
        ({"exp_avg_sq": torch.zeros(7)}, ValueError, "exp_avg_sq has 7 elements"),
        ({"param_out": torch.zeros(4, dtype=torch.bfloat16)}, ValueError, "param_out has 4 elements"),
        ({"param": torch.zeros(16)[::2]}, ValueError, "param must be contiguous"),
        ({"grad": torch.zeros(8, 2, dtype=torch.bfloat16)[:, 0]}, ValueError, "grad must be contiguous"),
        ({"param": torch.zeros(8, device="meta")}, ValueError, "param must be on the CPU"),
        ({"lr": -1.0}, ValueError, "lr must be >= 0"),
        ({"beta1": 1.0}, ValueError, "betas must be in"),
        ({"beta2": -0.1}, ValueError, "betas must be in"),
        ({"eps": -1e-8}, ValueError, "eps must be >= 0"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay must be >= 0"),
        ({"step": 0}, ValueError, "step must be an int >= 1"),
        ({"step": 1.0}, ValueError, "step must be an int >= 1"),
        ({"grad_scale": 0.0}, ValueError, "grad_scale must be positive"),
        ({"grad_scale": float("inf")}, ValueError, "grad_scale must be positive"),
        ({"num_threads": 0}, ValueError, "num_threads must be at least 1"),
    ],
)
def test_rejects_invalid_arguments(change, error, match):
    kwargs = dict(_valid(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, step=1)
    kwargs.update(change)
    tensors = [kwargs.pop(name) for name in ("param", "grad", "exp_avg", "exp_avg_sq", "param_out")]
    hyper = ops.GroupHyper(**{name: kwargs.pop(name) for name in ("lr", "beta1", "beta2", "eps", "weight_decay",
                                                                  "decoupled")})
    with pytest.raises(error, match=match):
        ops.fused_adamw_(*tensors, hyper, **kwargs)


def _sourced_state(n: int, offset: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Source states (master, exp_avg, exp_avg_sq) and destinations filled with other values (a stale slot), apart
    from them, all ``offset`` elements into their storage: with 0 each starts on a cache line, so a long step streams
    its stores past the cache."""
    gen = torch.Generator().manual_seed(seed)
    sources = [_slice(torch.empty(n + offset), offset, n) for _ in range(3)]
    sources[0].copy_(torch.randn(n, generator=gen))
    sources[1].copy_(torch.randn(n, generator=gen) * 0.01)
    sources[2].copy_(torch.rand(n, generator=gen) * 1e-4)
    return sources, [_slice(torch.empty(n + offset), offset, n).copy_(torch.randn(n, generator=gen)) for _ in range(3)]


def _step_both_ways(step_fn, n: int, offset: int, seed: int, grad: torch.Tensor, out_dtype, decoupled: bool,
                    grad_scale: float, step: int, num_threads: int | None = None) -> None:
    """One step in place on copies of the sources, one from the sources into stale destinations: every result and
    the 16-bit copy must have the same bits, and the sources must not change."""
    hyper = ops.GroupHyper(lr=LRS[step % len(LRS)], beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                           weight_decay=WEIGHT_DECAY, decoupled=decoupled)
    sources, destinations = _sourced_state(n, offset, seed)
    before = [s.clone() for s in sources]
    in_place = [s.clone() for s in sources]
    outs = [None if out_dtype is None else torch.empty(n, dtype=out_dtype) for _ in range(2)]
    step_fn(*in_place[:1], grad, *in_place[1:], outs[0], hyper, step=step, grad_scale=grad_scale,
            num_threads=num_threads)
    step_fn(destinations[0], grad, destinations[1], destinations[2], outs[1], hyper, step=step, grad_scale=grad_scale,
            num_threads=num_threads, param_src=sources[0], exp_avg_src=sources[1], exp_avg_sq_src=sources[2])
    where = f"n={n} offset={offset} step={step} out={out_dtype} scale={grad_scale}"
    for name, mine, theirs, source, kept in zip(("param", "exp_avg", "exp_avg_sq"), destinations, in_place, sources,
                                                before):
        assert_bitwise(mine, theirs, f"{name} {where}")
        assert_bitwise(source, kept, f"source {name} changed, {where}")
    if out_dtype is not None:
        assert_bitwise(outs[1], outs[0], f"param_out {where}")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_out_of_place_equals_in_place(native_isa, native_sqrt, decoupled, grad_dtype):
    """Reading the states from one slot and writing another gives the bits of the step in place, for every code
    path, sqrt (fused, or the moments/apply halves around torch's), copy dtype, length around the vector widths,
    weight decay mode and loss scale; the sources stay as they were."""
    out_dtypes = (None, torch.bfloat16, torch.float16, torch.float32)
    for case, (n, offset) in enumerate((n, o) for n in SIZES for o in (0, 3)):
        grad_scale = (1.0, 1024.0)[case % 2]
        gen = torch.Generator().manual_seed(case)
        grad = (torch.randn(n, generator=gen) * 0.1 * grad_scale).to(grad_dtype)
        for out_dtype in out_dtypes:
            _step_both_ways(ops.fused_adamw_, n, offset, case, grad, out_dtype, decoupled, grad_scale,
                            step=1 + case % 5)


@pytest.mark.parametrize("offset", [0, 1], ids=["streamed", "unaligned"])
def test_out_of_place_threads_equal_in_place(native_isa, native_sqrt, offset):
    """Several threads, each with its own range and the last with a partial vector, read the sources alike, whether
    their stores stream past the cache or not."""
    n = 3 * 32768 + 77
    grad = torch.randn(n, generator=torch.Generator().manual_seed(7)).bfloat16()
    _step_both_ways(ops.fused_adamw_, n, offset, 7, grad, torch.bfloat16, True, 1.0, step=4, num_threads=3)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_out_of_place_fallback_equals_in_place(monkeypatch, decoupled):
    """The torch step (without the kernel, and torch_adamw_) takes sources too, with the same numbers."""
    grad = (torch.randn(1031, generator=torch.Generator().manual_seed(3)) * 512).to(torch.float16)
    _step_both_ways(ops.torch_adamw_, 1031, 1, 3, grad, torch.bfloat16, decoupled, 512.0, step=2)
    monkeypatch.setattr(ops, "_C", None)
    monkeypatch.setattr(ops, "_fallback_warned", True)
    _step_both_ways(ops.fused_adamw_, 1031, 1, 3, grad, torch.float16, decoupled, 512.0, step=2)


@pytest.mark.parametrize("n", [517, 70_001])
def test_some_states_in_place_the_others_from_sources(native_isa, native_sqrt, n):
    """A master updated in place (one kept in the host cache) beside moments read from the committed slot, or the
    other way round; the long step streams the stores of the states that move."""
    grad = torch.randn(n, generator=torch.Generator().manual_seed(4))
    hyper = ops.GroupHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
    sources, destinations = _sourced_state(n, 0, 4)
    reference = [s.clone() for s in sources]
    out, ref_out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    ops.fused_adamw_(reference[0], grad, reference[1], reference[2], ref_out, hyper, step=3)
    master = sources[0].clone()
    ops.fused_adamw_(master, grad, destinations[1], destinations[2], out, hyper, step=3,
                     exp_avg_src=sources[1], exp_avg_sq_src=sources[2])
    for mine, theirs in zip((master, destinations[1], destinations[2], out), (*reference, ref_out)):
        assert_bitwise(mine, theirs, "moments moved")
    moments = [s.clone() for s in sources[1:]]
    ops.fused_adamw_(destinations[0], grad, moments[0], moments[1], out, hyper, step=3, param_src=sources[0])
    for mine, theirs in zip((destinations[0], *moments, out), (*reference, ref_out)):
        assert_bitwise(mine, theirs, "master moved")


def _shifted(storage: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Eight elements of ``storage`` one element past ``t``'s start."""
    return storage[t.storage_offset() + 1 : t.storage_offset() + 9]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize(
    ("sources", "match"),
    [
        (lambda s, p, m, v: {"exp_avg_src": _shifted(s, m)}, "exp_avg_src overlaps exp_avg"),
        (lambda s, p, m, v: {"param_src": m}, "param_src overlaps exp_avg"),
        (lambda s, p, m, v: {"exp_avg_sq_src": _shifted(s, p)}, "exp_avg_sq_src overlaps param"),
        (lambda s, p, m, v: {"param_src": s[29:37]}, "param_src overlaps param_out"),
        (lambda s, p, m, v: {"exp_avg_src": torch.zeros(8, dtype=torch.bfloat16)}, "exp_avg_src must be torch.float32"),
        (lambda s, p, m, v: {"param_src": torch.zeros(9)}, "param_src has 9 elements"),
        (lambda s, p, m, v: {"exp_avg_sq_src": torch.zeros(16)[::2]}, "exp_avg_sq_src must be contiguous"),
    ],
    ids=["shifted", "another-destination", "shifted-other", "out", "dtype", "size", "strided"],
)
def test_rejects_sources_that_are_not_apart(monkeypatch, native, sources, match):
    """A source must be its destination or share no byte with any destination: the step would read what it has just
    written. Sources are checked like the other tensors, and nothing is written."""
    if native and ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    if not native:
        monkeypatch.setattr(ops, "_C", None)
        monkeypatch.setattr(ops, "_fallback_warned", True)
    storage = torch.zeros(40)
    param, exp_avg, exp_avg_sq = storage[0:8], storage[10:18], storage[20:28]
    out = storage[30:34].view(torch.bfloat16)
    hyper = ops.GroupHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    before = storage.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        ops.fused_adamw_(param, torch.ones(8), exp_avg, exp_avg_sq, out, hyper, step=1,
                         **sources(storage, param, exp_avg, exp_avg_sq))
    assert torch.equal(storage, before)


def test_kernel_refuses_overlapping_addresses():
    """The raw kernel checks too: a source one element off its destination is refused before anything is written."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    storage = torch.ones(64)
    param, exp_avg, exp_avg_sq, grad = storage[0:16], storage[16:32], storage[32:48], storage[48:64]
    before = storage.clone()
    args = (param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), 0, 16, ops._C.FLOAT32,
            ops._C.NONE, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, 1.0, 1)
    with pytest.raises(ValueError, match="overlaps a destination"):
        ops._C.adamw(*args, src_param=storage[1:17].data_ptr())
    with pytest.raises(ValueError, match="overlaps a destination"):
        ops._C.adamw(*args, src_exp_avg_sq=storage[10:26].data_ptr())
    assert torch.equal(storage, before)
    ops._C.adamw(*args, src_param=param.data_ptr())
    assert not torch.equal(param, before[0:16])


@pytest.mark.parametrize("n", [1, 17, 1024, 1025, 3 * 32768 + 77])
@pytest.mark.parametrize("apart", [False, True], ids=["in_place", "slots"])
def test_kernel_checksums_the_new_states_as_the_store_would(native_isa, native_sqrt, n, apart):
    """The block checksums the kernel adds up on the way are those of the bytes it wrote (each state a key of its
    own, one sum per 4096 bytes), for every code path, sqrt, length around the vectors and blocks, in place or from
    the other slot, on one thread or three; and asking for them changes no bit of the step."""
    gen = torch.Generator().manual_seed(n)
    param, exp_avg, exp_avg_sq = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n)
    grad = torch.randn(n, generator=gen).bfloat16()
    hyper = ops.GroupHyper(lr=1e-3, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
                           decoupled=True)
    blocks = -(-n * 4 // checksum.BLOCK_BYTES)
    for num_threads in (1, 3):
        results = []
        for sums in (None, torch.full((3, blocks), 7, dtype=torch.int64)):
            states = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
            out = torch.empty(n, dtype=torch.bfloat16)
            if apart:
                sources = dict(zip(("param_src", "exp_avg_src", "exp_avg_sq_src"), states))
                states = [torch.empty(n) for _ in range(3)]
            else:
                sources = {}
            filled = ops.fused_adamw_(*states[:1], grad, *states[1:], out, hyper, step=3, num_threads=num_threads,
                                      sums=sums, **sources)
            assert filled == (sums is not None)
            results.append((states, out, sums))
        (plain, plain_out, _), (summed, summed_out, sums) = results
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), summed, plain):
            assert_bitwise(a, b, name)
        assert_bitwise(summed_out, plain_out, "param_out")
        for row, state in zip(sums, summed):
            raw = memoryview(state.view(torch.uint8).numpy())
            expected = [checksum.weighted32_checksum(raw[b * 4096 : (b + 1) * 4096], b * 4096) for b in range(blocks)]
            assert row.tolist() == expected, f"{num_threads} threads"


def test_kernel_checksums_need_room_for_every_block():
    """A sums tensor of the wrong shape or dtype is refused before the kernel writes through its address."""
    if ops._C is None:
        pytest.skip("lightning_ratel._C is not built")
    n = 2049
    state = [torch.zeros(n) for _ in range(3)]
    hyper = ops.GroupHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    for bad in (torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 3), torch.zeros(3, 6, dtype=torch.int64)[:, ::2]):
        with pytest.raises(ValueError, match="sums must be"):
            ops.fused_adamw_(state[0], torch.zeros(n), state[1], state[2], None, hyper, step=1, sums=bad)
    # An empty step has no block: it writes nothing, not even past the end of its empty sums.
    around = torch.full((12,), 7, dtype=torch.int64)
    for ieee in (True, False):
        ops.set_native_sqrt(ieee=ieee)
        empty = [torch.empty(0) for _ in range(4)]
        assert ops.fused_adamw_(*empty[:1], empty[1], *empty[2:], None, hyper, step=1, sums=around[:0].view(3, 0))
    ops.set_native_sqrt()
    assert bool((around == 7).all())
