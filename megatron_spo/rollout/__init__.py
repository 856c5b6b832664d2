"""Rollout fleet: SGLang-protocol engines behind sglang-router, weight sync and the async manager.

protocol.py       the SGLang HTTP subset as dataclasses (request/response bodies, weight-update bodies)
engine_server.py  `megatron-spo serve`: a transformers engine speaking that protocol (CPU or one GPU)
client.py         EngineClient (aiohttp) and blocking post_json/get_json: the only HTTP code
fleet.py          `megatron-spo fleet up` / Fleet: N engines + sglang-router, watchdog, clean teardown
weight_sync.py    WeightBroadcaster: bucketed broadcast (gloo/NCCL) or safetensors + update_weights_from_disk
manager.py        RolloutManager: async sampling, rewards, bounded buffer, staleness, retries, metrics; multi-turn
turns.py          a multi-turn conversation as token ids: observations tokenised once with the chat template's markers

Submodules are imported explicitly (they pull torch, transformers or aiohttp).
"""
