"""How closely two kernel paths must agree: one home, read by the kernel
tests (tests/kernels/kernels_testlib.py re-exports it) and by the GPU check
(scripts/gpu_check.py), so that both hold the kernels to the same bounds."""
import torch


def assert_close(actual, expected, dtype=torch.float32, what="", grad=False):
    """Forward values are fp32 on every path, so they agree tightly; gradients
    of low-precision inputs are rounded to that dtype, so compare them to the
    tensor's scale."""
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    if not grad:
        tol = 2e-5 if dtype == torch.float32 else 1e-4
        torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
        return
    scale = max(e.abs().max().item(), 1e-6)
    tol = 1e-5 if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 3e-3)
    err = (a - e).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs err {err:.3g} > {tol:g} * scale {scale:.3g}"
