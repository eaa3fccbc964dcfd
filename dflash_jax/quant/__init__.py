"""NVFP4: the value type (`nvfp4.NVFP4Array`, which carries its block and tensor scales), the one matmul that
consumes it (`linear.linear`), its W4A16 Pallas kernel, the ModelOpt quantization recipe and the scale audit.

The rule that keeps NVFP4 safe: only `linear` opens an `NVFP4Array` for a matmul; nothing else multiplies codes.
"""
