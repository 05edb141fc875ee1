"""Hugging Face interchange: `raylm export` (checkpoint -> HF model directory) and `raylm import`
(HF model directory -> a checkpoint that `raylm train` resumes from).

    reader.py      find a checkpoint (run directory or checkpoint, local or s3://), read its
                   DCP tensors one at a time, load a model for inference or evaluation
    adapters.py    one adapter per model family (Llama, GPT-2): HF config and key maps both ways
    safetensors_io.py  streaming, sharded safetensors writer; HF directory tensor reader
    hf.py          export and import themselves, tokenizer files included
"""
