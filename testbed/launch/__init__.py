"""Getting ranks running: spawning a local world, or joining one that torchrun or Slurm started."""
