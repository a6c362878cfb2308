"""Models: loading from hub ids, directories and the cache (loading), built-in tiny random models (tiny), the
hand-wired probe model (probe), GGUF files shipped in packages (packaged), and what they share (common)."""
