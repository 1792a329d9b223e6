FUSION_CHOICES = ("auto", "triton", "torch", "off")
def decode_to_images(vae, latent, fusion):
    raise NotImplementedError
