"""Ways to get memsave into the code paths users already run.

- `memsave.integrations.patch`: route `tf.gradients` & co. through memsave for a
  while (`memsave.patch`).
- `memsave.integrations.optimizers`: a configured gradient function and a
  `tf.compat.v1.train.Optimizer` wrapper (`memsave.gradient_function`,
  `memsave.MemsaveOptimizer`).
- `memsave.integrations.keras`: Keras 3 models whose `fit` uses memsave
  (`memsave.keras`); imported only when asked for, so `import memsave` never
  imports Keras.

Importing this package has no side effects: nothing is patched until asked.
"""
