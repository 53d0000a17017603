"""VEMoE (seed 002, Fed-VEMoE): a federated pool of LoRA experts with token routing, server-oblivious expert
aggregation and open-world expert management.

Built in steps (issue 32). Here so far: the math, as pure functions: ``routing.py`` (client: responsibilities from
probe losses, the top-m experts, the token mixture) and ``pool.py`` (server: the constant-length payload, the
experts from its sum, prune / merge / birth). Not yet: the expert adapter under ``common/adapters/``, the server
and client halves, the config section and the registry entry, so ``strategy="vemoe"`` is still refused.
"""
