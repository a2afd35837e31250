"""A block-diffusion model's runtime (DiffusionGemma): requests write a canvas at a time, and
join or leave the running batch at canvas boundaries."""
