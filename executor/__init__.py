"""The reference executor (PyTorch): real offloaded decoding that records traces.

Not built yet (issue 3). It will drive ``moesim.policy.Planner`` with real copies, so the
simulator and the executor share one definition of every policy decision.
"""
