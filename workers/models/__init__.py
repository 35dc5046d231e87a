"""The built-in decoder models (GPT, Llama), their config, and the factory that builds a model from
the spec.
"""
