"""The core both adapters (Trainer and Fabric) share: settings, process group and mesh, setup of a model and its
optimizers, buffers, what a run changes and how to undo it."""
