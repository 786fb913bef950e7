"""Loading: a checkpoint (GGUF file or Hugging Face folder) becomes pellucid's modules. This is
the one place that knows both the file formats (weights/) and the model (models/)."""
