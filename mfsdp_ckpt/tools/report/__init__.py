"""HTML (and PNG) reports of checkpoints: ``inspect --html`` draws where every chunk lives;
``diff --html`` shows which tensors differ and by how much."""
