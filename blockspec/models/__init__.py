"""Models and checkpoints: the target (`CausalLM`), the DFlash draft (`DFlashDraft`), their configs, loading
and saving, the tokenizer, and the embedded default model."""
