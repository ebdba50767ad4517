// A real OpenID provider for the hub's sign-in tests: node-oidc-provider (OpenID certified), on
// loopback, with one static confidential client and test accounts whose groups the tests choose.
//
//   node provider.mjs NODE_MODULES CONFIG.json
//
// NODE_MODULES: the node_modules folder oidc-provider was installed in (.ci/run: .ci/node/).
//
// CONFIG.json: {"port", "client_id", "client_secret", "redirect_uris": [...],
//               "accounts": {"login": {"email", "name", "groups": [...]}}}
// Sign-in is oidc-provider's own development interaction (a form asking for a login; any
// password-less login named in "accounts" signs in); consent is granted without a prompt (the
// hub is a first-party client). Prints "oidc provider listening on ISSUER" once it serves.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const entry = join(process.argv[2], 'oidc-provider', 'lib', 'index.js');
const { default: Provider } = await import(pathToFileURL(entry).href);
const config = JSON.parse(readFileSync(process.argv[3], 'utf8'));
const issuer = `http://127.0.0.1:${config.port}`;
const accounts = config.accounts;

const provider = new Provider(issuer, {
  clients: [
    {
      client_id: config.client_id,
      client_secret: config.client_secret,
      redirect_uris: config.redirect_uris,
      response_types: ['code'],
      grant_types: ['authorization_code'],
      token_endpoint_auth_method: 'client_secret_basic',
    },
  ],
  pkce: { required: () => true },
  scopes: ['openid', 'email', 'profile', 'groups'],
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['name'],
    groups: ['groups'],
  },
  // the ID token carries the claims itself (the hub reads it, not the userinfo endpoint)
  conformIdTokenClaims: false,
  async findAccount(ctx, id) {
    const found = accounts[id];
    if (found === undefined) return undefined;
    return {
      accountId: id,
      async claims() {
        return {
          sub: id,
          email: found.email,
          email_verified: true,
          name: found.name,
          groups: found.groups,
        };
      },
    };
  },
  async loadExistingGrant(ctx) {
    // a first-party client: every scope it asks for is granted without a consent prompt
    const grant = new ctx.oidc.provider.Grant({
      clientId: ctx.oidc.client.clientId,
      accountId: ctx.oidc.session.accountId,
    });
    grant.addOIDCScope('openid email profile groups');
    await grant.save();
    return grant;
  },
  features: { devInteractions: { enabled: true } },
  cookies: { keys: ['alp-gateway-test-cookie-key'] },
});

provider.listen(config.port, '127.0.0.1', () => {
  console.log(`oidc provider listening on ${issuer}`);
});
