"""The reference executor (PyTorch): real offloaded decoding that records traces.

It drives ``moesim.policy.Planner`` with real copies (CUDA copy stream, or a CPU emulated
link), so the simulator and the executor share one definition of every policy decision.
See docs/executor.md.
"""
