"""Training: corpus -> token shards -> the same nn.Modules pellucid serves -> checkpoints -> served model.

    pellucid data prepare shakespeare --tokenizer char --out data/shakespeare_char
    pellucid train --data data/shakespeare_char --out runs/baby      # writes runs/baby/model too
    pellucid generate "ROMEO:" --model runs/baby/model
Also: `tokenizer train` (byte-level BPE), `scale` (loss vs compute), `sft` (chat fine-tuning,
LoRA), `export` (HF folder or GGUF), and `torchrun --nproc-per-node N -m pellucid train` (DDP).
"""
