"""The OpenAI-compatible API: request/response models (``protocol``) and their serving."""
