"""Platform helpers, private: BLAS preload, CPU memory, cache folder, atomic writes,
MoE on the CPU."""
