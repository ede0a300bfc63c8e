//! Simulated vLLM/SGLang engine (placeholder; built in its own issue).
