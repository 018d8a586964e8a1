"""What computes: the model runner, the models, the weight loaders (HF folders, safetensors,
GGUF), the memory plan that sizes the KV pool, and the caches that skip work on later starts."""
