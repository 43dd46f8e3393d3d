"""One file per Hugging Face ``model_type``; pure nn.Modules with Hugging Face class and parameter names."""
