"""Where a served model's files come from: a built-in name, a GGUF file (converted once into a
cached Hugging Face-style directory), a local Hugging Face directory, or the demo model. Every
process resolves ``--model`` here, so the gateway, the workers and ``pdserve up`` agree."""
