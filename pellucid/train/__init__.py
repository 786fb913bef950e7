"""Training: corpus -> token shards -> the same nn.Modules pellucid serves -> checkpoints -> HF folder.

pellucid data prepare shakespeare --tokenizer char --out data/shakespeare_char
pellucid train --data data/shakespeare_char --out runs/baby
pellucid generate "ROMEO:" --model runs/baby/model
"""
