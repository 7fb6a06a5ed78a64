"""Scripts run on their own (``scripts/gpu_check.sh``, ``scripts/gpu_check.py``)
and the helpers they share with the benchmarks (``fused_loss_case``).

A regular package, so that ``scripts.fused_loss_case`` is this checkout's even
where another ``scripts`` is installed. It may import rcgrpo and
rcgrpo_kernels, never tests/ or benchmarks/ (tests/test_layout.py checks
that); benchmarks may import it.
"""
