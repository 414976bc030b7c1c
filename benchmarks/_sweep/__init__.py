"""The Hugging Face sweep's parts: tiny models built from any config class (`build`)."""
