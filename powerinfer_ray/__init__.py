"""powerinfer-ray: PowerInfer-style hybrid CPU/GPU sparse LLM inference on Ray."""
__version__ = "0.1.0"
