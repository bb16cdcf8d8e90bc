"""Where models come from and how they are loaded: sources (packaged, GGUF, Hub cache), loading, attached drafters, chat templates."""
