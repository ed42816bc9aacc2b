// TLS and mutual TLS on the real server, with the real client library and tinkerctl. The
// certificates come from a throwaway CA made with the openssl command line for each test.
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "client/client.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

// A CA, a server certificate for 127.0.0.1/localhost signed by it, a client certificate signed by
// it, and a "rogue" client certificate signed by a second CA the server does not trust.
struct Pki {
  TempDir dir;
  Pki() {
    const std::string d = dir.path() + "/";
    const std::string key = " -newkey rsa:2048 -nodes";
    const std::string script =
        "set -e; cd " + d + "\n" +
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext\n" +
        "printf 'extendedKeyUsage=clientAuth\\n' > client.ext\n" + "openssl req -x509" + key +
        " -days 1 -subj /CN=tinkerd-test-ca -keyout ca.key -out ca.pem\n" + "openssl req -x509" +
        key + " -days 1 -subj /CN=rogue-ca -keyout rogue-ca.key -out rogue-ca.pem\n" +
        "sign() { openssl req" + key + " -subj /CN=$1 -keyout $1.key -out $1.csr; " +
        "openssl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial -days 1 "
        "-extfile $3 -out $1.pem; }\n" +
        "sign server ca server.ext\nsign client ca client.ext\nsign rogue rogue-ca client.ext\n";
    std::ofstream(d + "make.sh") << script;
    ok = std::system(("sh " + d + "make.sh >" + d + "openssl.log 2>&1").c_str()) == 0;
  }
  std::string Path(const std::string& name) const { return dir.Sub(name); }
  bool ok = false;
};

ServerConfig TlsServer(const Pki& pki, bool mutual) {
  ServerConfig sc;
  sc.tls_cert_file = pki.Path("server.pem");
  sc.tls_key_file = pki.Path("server.key");
  if (mutual) sc.tls_client_ca_file = pki.Path("ca.pem");
  return sc;
}

// A client of `live` over TLS that trusts the test CA and presents `who`.pem, if `who` is set.
std::shared_ptr<client::Connection> Connect(const LiveServer& live, const Pki& pki,
                                            const std::string& who) {
  client::ClientOptions o;
  o.target = "127.0.0.1:" + std::to_string(live.server->port());
  o.max_attempts = 1;  // a refused handshake would be refused again
  o.deadline = std::chrono::milliseconds(20000);
  absl::Status s =
      client::LoadTlsFiles(pki.Path("ca.pem"), who.empty() ? "" : pki.Path(who + ".pem"),
                           who.empty() ? "" : pki.Path(who + ".key"), o);
  EXPECT_TRUE(s.ok()) << s.message();
  return client::Connection::Create(o);
}

TEST(Tls, ServerSpeaksTlsAndRefusesPlaintext) {
  Pki pki;
  ASSERT_TRUE(pki.ok) << "openssl is needed for this test";
  LiveServer live(TlsServer(pki, /*mutual=*/false));  // its own channel is plaintext
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  v1::ListModelsResponse list;
  EXPECT_FALSE(live.stub->ListModels(&ctx, v1::ListModelsRequest(), &list).ok());

  auto conn = Connect(live, pki, "");  // server-only TLS: no client certificate needed
  auto info = conn->CreateModel(v1::CreateModelRequest());
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_EQ(info->model_id().rfind("model-", 0), 0u);
}

TEST(MutualTls, OnlyClientsWithACertificateFromTheTrustedCaGetIn) {
  Pki pki;
  ASSERT_TRUE(pki.ok) << "openssl is needed for this test";
  LiveServer live(TlsServer(pki, /*mutual=*/true));

  // No client certificate, and one from a CA the server does not trust: both refused at the
  // handshake, so neither request reaches the service.
  for (const std::string who : {"", "rogue"}) {
    auto refused = Connect(live, pki, who);
    auto info = refused->CreateModel(v1::CreateModelRequest());
    EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable) << "client '" << who << "'";
  }
  EXPECT_EQ(live.server->runner()->ListModels().size(), 0u);

  // The trusted client trains through the same path as a plaintext client and gets the same
  // numbers as the in-process runner.
  auto conn = Connect(live, pki, "client");
  v1::CreateModelRequest req;
  req.set_seed(5);
  auto info = conn->CreateModel(req);
  ASSERT_TRUE(info.ok()) << info.status().message();
  auto tc = conn->Attach(info->model_id());
  SplitMix64 g(8);
  const auto data = RandomData(g, {6, 11}, "cross_entropy", 128);
  std::vector<v1::Datum> wire;
  for (const Datum& d : data) wire.push_back(ToProto(d));
  v1::LossFn loss;
  loss.set_name("cross_entropy");
  auto fb = tc->ForwardBackward(wire, loss).get();
  ASSERT_TRUE(fb.ok()) << fb.status().message();
  auto local = MakeRunner(live.model_dir);
  CreateModelOptions o;
  o.seed = 5;
  const std::string local_id = *local->CreateModel(o);
  EXPECT_EQ(fb->metrics().at("loss:sum"),
            local->ForwardBackward(local_id, data, "cross_entropy", {})->metrics.at("loss:sum"));
  EXPECT_EQ(live.server->runner()->ListModels().size(), 1u);

  // tinkerctl: with the client certificate it lists the model; without one it fails.
  const std::string tls = "--deadline_ms=5000 --tls_ca=" + pki.Path("ca.pem");
  auto [code, out] = Ctl(live, tls + " --tls_cert=" + pki.Path("client.pem") +
                                   " --tls_key=" + pki.Path("client.key") + " list");
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find(info->model_id()), std::string::npos) << out;
  auto [anon_code, anon_out] = Ctl(live, tls + " list");
  EXPECT_EQ(anon_code, 1) << anon_out;
  // A certificate without its key is a usage error, caught before connecting.
  auto [half_code, half_out] = Ctl(live, tls + " --tls_cert=" + pki.Path("client.pem") + " list");
  EXPECT_EQ(half_code, 2) << half_out;
}

// curl against the Tinker HTTP API: (exit code, body). `args` are curl's TLS options.
std::pair<int, std::string> Curl(const std::string& url, const std::string& args) {
  FILE* p = popen(("curl -s --max-time 20 " + args + " " + url + " 2>&1").c_str(), "r");
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(Tls, TheTinkerHttpApiUsesTheSameCertificateAndClientCa) {
  Pki pki;
  ASSERT_TRUE(pki.ok);
  for (bool mutual : {false, true}) {
    ServerConfig sc = TlsServer(pki, mutual);
    sc.tinker_http.listen = "127.0.0.1:0";
    sc.tinker_http.served_model_name = "tiny";
    LiveServer live(sc);
    const std::string host = "127.0.0.1:" + std::to_string(live.server->tinker_http_port());
    const std::string ca = "--cacert " + pki.Path("ca.pem");
    const std::string cert =
        " --cert " + pki.Path("client.pem") + " --key " + pki.Path("client.key");
    const std::string rogue =
        " --cert " + pki.Path("rogue.pem") + " --key " + pki.Path("rogue.key");
    auto [code, body] = Curl("https://" + host + "/api/v1/healthz", ca + cert);
    EXPECT_EQ(code, 0) << body;
    EXPECT_EQ(body, "{\"status\":\"ok\"}") << "mutual=" << mutual;
    // Plain HTTP on the TLS port gets no answer; an untrusted server certificate is refused.
    auto [plain_code, plain] = Curl("http://" + host + "/api/v1/healthz", "");
    EXPECT_NE(plain.find("\"status\""), 0u) << plain;
    EXPECT_NE(plain_code, 0);
    EXPECT_NE(Curl("https://" + host + "/api/v1/healthz", cert).first, 0) << "no CA, yet trusted";
    // Under mutual TLS a client without a certificate, or with one from another CA, gets nothing.
    EXPECT_EQ(Curl("https://" + host + "/api/v1/healthz", ca).first == 0, !mutual);
    EXPECT_EQ(Curl("https://" + host + "/api/v1/healthz", ca + rogue).first == 0, !mutual);
  }
}

}  // namespace
}  // namespace tinkerd::testing
