"""Hugging Face integration: the causal-LM preset (Llama, Qwen2, Qwen3, with LoRA) and the chunked LM-head loss;
any other transformer with a list of layers through its base model, recorded and cut at the layers.

``transformers`` and ``peft`` are optional (the ``[hf]`` extra) and imported only when a model of theirs is found.
"""
