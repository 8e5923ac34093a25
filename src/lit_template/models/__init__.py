from lit_template.models.classifier import LitClassifier
from lit_template.models.nets import MLP, SmallCNN, torchvision_net

__all__ = ["MLP", "LitClassifier", "SmallCNN", "torchvision_net"]
