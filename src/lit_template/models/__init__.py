from lit_template.models.classifier import LitClassifier
from lit_template.models.gpt import GPT, GPTNet
from lit_template.models.nets import MLP, SmallCNN, torchvision_net

__all__ = ["GPT", "MLP", "GPTNet", "LitClassifier", "SmallCNN", "torchvision_net"]
