"""Layers the convolutional and transformer models share.

Convolutions and BatchNorm follow PyTorch's initialization and defaults, so
that parameter counts and training behaviour match the reference models.
"""

from flax import nnx

# PyTorch's kaiming_normal_(mode="fan_out", nonlinearity="relu"), which
# torchvision uses for every conv in ResNet and VGG.
conv_init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def check_dropout_rngs(model, rate, train, rngs):
  # nnx.Dropout's own error on a missing key does not say which argument to
  # pass; fail early with one that does.
  if train and rate > 0 and rngs is None:
    raise ValueError(
        f"{type(model).__name__} has dropout={rate} and train=True, so it"
        " needs rngs=nnx.Rngs(dropout=key) at call time; got rngs=None"
    )


def conv(in_ch, out_ch, kernel, *, strides=1, use_bias=False, rngs):
  # Symmetric padding k // 2 as in PyTorch: "SAME" pads strided convs
  # asymmetrically, which would shift every feature map by one pixel.
  pad = kernel // 2
  return nnx.Conv(
      in_ch,
      out_ch,
      (kernel, kernel),
      strides=strides,
      padding=((pad, pad), (pad, pad)),
      use_bias=use_bias,
      kernel_init=conv_init,
      rngs=rngs,
  )


def batch_norm(num_features, axis_name, rngs):
  return nnx.BatchNorm(
      num_features,
      momentum=0.9,
      epsilon=1e-5,
      axis_name=axis_name,
      rngs=rngs,
  )


class ConvBN(nnx.Module):
  """A bias-free conv followed by BatchNorm."""

  def __init__(
      self, in_ch, out_ch, kernel, *, strides=1, batch_norm_axis, rngs
  ):
    self.conv = conv(in_ch, out_ch, kernel, strides=strides, rngs=rngs)
    self.bn = batch_norm(out_ch, batch_norm_axis, rngs)

  def __call__(self, x, *, train):
    return self.bn(self.conv(x), use_running_average=not train)
