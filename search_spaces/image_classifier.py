"""A small Flax NNX image classifier and its batch: ``[batch, H, W, C]`` float images and int32
labels, as a vision team's data loader hands them over. ``image-classifier.yaml`` searches it
with this batch factory and this loss (no tokens anywhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name


class ConvBlock(nnx.Module):
    """Two 3×3 convolutions with a residual, as a ResNet's basic block."""

    def __init__(self, channels: int, *, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = checkpoint_name(jax.nn.relu(self.conv1(x)), "conv_hidden")
        return jax.nn.relu(x + self.conv2(h))


class Classifier(nnx.Module):
    """``images [batch, H, W, C] -> logits [batch, classes]``: a stem, ``layers`` blocks, a head."""

    def __init__(self, channels: int, layers: int, classes: int, *, rngs: nnx.Rngs) -> None:
        self.stem = nnx.Conv(3, channels, (3, 3), rngs=rngs)
        self.blocks = nnx.List([ConvBlock(channels, rngs=rngs) for _ in range(layers)])
        self.head = nnx.Linear(channels, classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


def example_batch(key: jax.Array, batch: int, size: int, classes: int) -> dict[str, jax.Array]:
    """One batch as the data loader gives it: ``image`` float32 ``[batch, size, size, 3]``,
    ``label`` int32 ``[batch]``."""
    image_key, label_key = jax.random.split(key)
    return {
        "image": jax.random.normal(image_key, (batch, size, size, 3), jnp.float32),
        "label": jax.random.randint(label_key, (batch,), 0, classes, jnp.int32),
    }


def cross_entropy(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """The mean softmax cross-entropy of the logits against the batch's labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float = 0.1) -> jax.Array:
    """The mean cross-entropy against labels smoothed by ``smoothing`` (the team's own loss)."""
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), smoothing)
    return optax.softmax_cross_entropy(logits, targets).mean()


@nnx.jit
def train_step(model: Classifier, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
    """The team's own step, as Flax's guides write one: the gradients of its loss, one update of
    the optimizer in place, the loss returned. ``own-train-step.yaml`` searches this step."""

    def loss_fn(model: Classifier) -> jax.Array:
        return smoothed_cross_entropy(model(batch["image"]), batch["label"])

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss
